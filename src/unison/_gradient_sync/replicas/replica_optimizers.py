"""The optimizer each replica steps: the user's one optimizer, run once per replica on its own components.

The user makes one optimizer over the strategy's variables, and every replica thread
calls ``opt.step()``. Replica 0 steps its components (the variables' plain component 0)
with the user's optimizer state (``PrimaryShadow``, ``first_replica_optimizer.py``: its
``state_dict()`` is the user's); replica ``i`` steps a shadow copy of the optimizer over
component ``i`` with its own per-device state (``shadow_optimizers.py``). Every replica
applies the same reduced gradients, so every replica's state equals replica 0's. Each
takes the user's current hyperparameters before its step, so learning-rate schedulers
keep working. Under central storage only replica 0 steps, since all replicas share one
storage: the others' shadows step nothing.
"""

from __future__ import annotations

import threading
import typing
import weakref
from collections import defaultdict
from collections.abc import Callable

import torch

from unison._gradient_sync.replicas.first_replica_optimizer import PrimaryShadow
from unison._gradient_sync.replicas.replica_zero_grad import install_replica_zero_grad
from unison._gradient_sync.replicas.shadow_optimizers import follow_hyperparameters, shadow_optimizer
from unison._values.storage import MIRRORED, VariableStorage
from unison._values.variables import DistributedVariable

__all__ = ["ReplicaOptimizers"]


@typing.final
class ReplicaOptimizers:
    """The optimizers that step each replica's components, for every user optimizer of a strategy.

    Args:
        num_replicas: this worker's replicas.
        storage: where the variables keep their components; unless its replicas step
            (central storage), the shadows of replicas 1.. step nothing.
        replica_of: the local replica id of the calling thread's replica, or None outside
            the replicas (for the replicas' ``zero_grad``, ``replica_zero_grad.py``).
    """

    def __init__(self, num_replicas: int, *, storage: VariableStorage = MIRRORED,
                 replica_of: Callable[[], int | None]):
        self._num_replicas = num_replicas
        self._storage = storage
        self._replica_of = replica_of
        self._shadows: weakref.WeakKeyDictionary[torch.optim.Optimizer, list] = weakref.WeakKeyDictionary()
        self._shadows_lock = threading.Lock()
        self._watched: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()  # load_state_dict hooked
        # replica 0 steps the variables' plain components 0 with the user's state (first_replica_optimizer.py)
        self._primaries: weakref.WeakKeyDictionary[torch.optim.Optimizer, PrimaryShadow] = weakref.WeakKeyDictionary()

    def for_replica(self, optimizer: torch.optim.Optimizer, replica_id: int) -> torch.optim.Optimizer:
        """The optimizer that steps replica ``replica_id``'s components now, with the user's
        current hyperparameters."""
        if replica_id == 0:
            # the other replicas' shadows copy the user's state when made: make them before
            # replica 0's step changes it (they are made once, and again after a load_state_dict)
            self._shadows_of(optimizer)
            primary = self._primaries.get(optimizer)
            if primary is None:
                primary = self._primaries[optimizer] = PrimaryShadow(optimizer)
            return primary.for_step(optimizer)
        return self._shadow(optimizer, replica_id)

    def _shadows_of(self, optimizer: torch.optim.Optimizer) -> list:
        """Replicas 1..'s shadows of ``optimizer``, made (once) with copies of its state.

        Every replica applies the same reduced gradients, so every replica's optimizer
        state equals replica 0's, which is the user's: a state the user loaded
        (``optimizer.load_state_dict``, a checkpoint's resume) is every replica's. Loading
        one drops the shadows, and the next step makes them again from it.
        """
        shadows = self._shadows.get(optimizer)
        if shadows is None:
            with self._shadows_lock:
                shadows = self._shadows.get(optimizer)
                if shadows is None:
                    shadows = [self._make_shadow(optimizer, i) for i in range(1, self._num_replicas)]
                    self._shadows[optimizer] = shadows
                    if optimizer not in self._watched:  # once per optimizer, not per step
                        self._watched.add(optimizer)
                        optimizer.register_load_state_dict_post_hook(_ForgetShadows(self))
                        install_replica_zero_grad(optimizer, self._replica_of)
        return shadows

    def _forget_shadows(self, optimizer: torch.optim.Optimizer) -> None:
        self._shadows.pop(optimizer, None)

    def _shadow(self, optimizer: torch.optim.Optimizer, replica_id: int) -> torch.optim.Optimizer:
        shadows = self._shadows_of(optimizer)
        shadow = shadows[replica_id - 1]
        if self._storage.replicas_step and len(shadow.param_groups) != len(optimizer.param_groups):
            # add_param_group: a new shadow over every group, keeping the state so far
            state = shadow.state
            shadow = shadows[replica_id - 1] = self._make_shadow(optimizer, replica_id)
            shadow.state = state
        follow_hyperparameters(shadow, optimizer)
        return shadow

    def _make_shadow(self, optimizer: torch.optim.Optimizer, replica_id: int) -> torch.optim.Optimizer:
        state: defaultdict = defaultdict(dict)
        if not self._storage.replicas_step:
            return shadow_optimizer(optimizer, [], state)
        groups = []
        with torch._C.DisableTorchFunctionSubclass():
            for group in optimizer.param_groups:
                params = []
                for param in group["params"]:
                    if not isinstance(param, DistributedVariable):
                        continue
                    component = param.component(replica_id)
                    params.append(component)
                    variable = typing.cast(torch.Tensor, param)  # a tensor subclass, not typed as one
                    if optimizer.state.get(variable):
                        state[component] = _state_copy(optimizer.state[variable], variable.device, component.device)
                groups.append({**group, "params": params})
        return shadow_optimizer(optimizer, groups, state)


@typing.final
class _ForgetShadows:
    """An optimizer's ``load_state_dict`` post-hook: its replica shadows are made again from the loaded state."""

    def __init__(self, optimizers: ReplicaOptimizers):
        self._optimizers = weakref.ref(optimizers)  # the hook must not keep the strategy's synchroniser alive

    def __call__(self, optimizer: torch.optim.Optimizer) -> None:
        optimizers = self._optimizers()
        if optimizers is not None:
            optimizers._forget_shadows(optimizer)


def _state_copy(state: dict, device: torch.device, to: torch.device) -> dict:
    """A copy of one parameter's optimizer state for a replica's component on ``to``.

    Tensors on the variable's own device (momentum buffers, Adam moments) are copied to
    ``to``; others (Adam's CPU ``step`` count) are copied where they are.
    """
    return {key: (value.detach().to(to if value.device == device else value.device, copy=True)
                  if isinstance(value, torch.Tensor) else value)
            for key, value in state.items()}
