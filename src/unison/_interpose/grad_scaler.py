"""``torch.amp.GradScaler`` in a step that several replica threads run at once.

A mixed-precision step is written with one scaler for the process (``scaler.scale(loss)
.backward(); scaler.step(opt); scaler.update()``), and a strategy with several local
replicas runs that step in one thread per replica, all on the same scaler. The scaler
keeps per-iteration state per optimizer (unscaled yet? inf found?), keyed by the
optimizer, which every replica shares: the replicas' calls collided (``unscale_() has
already been called``, a replica stepping on scaled gradients, ``No inf checks were
recorded prior to update``) and each replica's ``update()`` moved the scale again.

So that the step works unchanged, as on one device, three things change while a
replica of a strategy with several local replicas calls the scaler (elsewhere the
scaler is PyTorch's, untouched):

- its per-optimizer state is the replica's own;
- ``step()`` all-reduces the replicas' inf checks first, so every replica (of every
  worker) steps or skips alike; an inf in one replica's gradients skips the step
  everywhere, as an inf in one device's batch does;
- ``update()`` is a merge: the scale moves once per step, from every replica's checks
  (called after ``strategy.run`` instead, it reads every replica's checks as well).

The scale itself stays one tensor, shared by the replicas. This patches the class
(the state is an attribute PyTorch reads in each method; there is no hook for it), once,
when the first strategy with several local replicas is made.
"""

from __future__ import annotations

import threading
import weakref
from collections import defaultdict
from typing import Any

import torch
from torch.amp import grad_scaler as torch_grad_scaler

from unison._context import ReplicaContext
from unison._interpose.registry import Interposition
from unison._reduce import ReduceOp
from unison._state import STATE
from unison._values.values import PerReplica

__all__ = ["install_grad_scaler_replicas", "replica_of_several"]

_STATE_NAME = "_per_optimizer_states"
_replica_states: weakref.WeakKeyDictionary[Any, dict[int, Any]] = weakref.WeakKeyDictionary()
_replica_states_lock = threading.Lock()


def replica_of_several() -> ReplicaContext | None:
    """The current replica's context, when its strategy runs several replicas in this process."""
    entry = STATE.top()
    context = entry.replica_context if entry is not None else None
    if context is None or len(context.strategy.extended.worker_devices) < 2:
        return None
    return context


def _fresh_states() -> Any:
    return defaultdict(torch_grad_scaler._refresh_per_optimizer_state)


def _states_of(scaler: Any) -> dict[int, Any]:
    states = _replica_states.get(scaler)
    if states is None:
        with _replica_states_lock:
            states = _replica_states.get(scaler)
            if states is None:
                states = _replica_states[scaler] = {}
    return states


def _get_states(scaler: Any) -> Any:
    context = replica_of_several()
    if context is None:
        try:
            return scaler.__dict__[_STATE_NAME]
        except KeyError:  # a disabled scaler never makes one
            raise AttributeError(f"{type(scaler).__name__!r} object has no attribute {_STATE_NAME!r}") from None
    states = _states_of(scaler)
    replica_id = context.local_replica_id
    mine = states.get(replica_id)
    if mine is None:
        mine = states[replica_id] = _fresh_states()
    return mine


def _set_states(scaler: Any, value: Any) -> None:
    context = replica_of_several()
    if context is None:
        scaler.__dict__[_STATE_NAME] = value
    else:
        _states_of(scaler)[context.local_replica_id] = value


_original_step = torch_grad_scaler.GradScaler.step
_original_update = torch_grad_scaler.GradScaler.update


def _step(self: Any, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
    """``GradScaler.step`` that, in a replica, agrees with every replica on skipping."""
    context = replica_of_several()
    if context is None or not self._enabled or "closure" in kwargs:
        return _original_step(self, optimizer, *args, **kwargs)
    state = self._per_optimizer_states[id(optimizer)]
    if state["stage"] is torch_grad_scaler.OptState.STEPPED:
        raise RuntimeError("step() has already been called since the last update().")
    if state["stage"] is torch_grad_scaler.OptState.READY:
        self.unscale_(optimizer)
    device = torch.device(context.devices[0])
    found = torch.zeros((), dtype=torch.float32, device=device)
    for found_inf in state["found_inf_per_device"].values():
        found += found_inf.to(device)
    found = context.all_reduce(ReduceOp.SUM, found)  # every replica of every worker steps or skips alike
    state["found_inf_per_device"] = {device: found}
    # the gradients are unscaled: a plain step (also for optimizers that could unscale themselves)
    result = None if found.item() else optimizer.step(*args, **kwargs)
    state["stage"] = torch_grad_scaler.OptState.STEPPED
    return result


def _update(self: Any, new_scale: Any = None) -> None:
    """``GradScaler.update`` that, in a replica, moves the shared scale once per step.

    Called after ``strategy.run`` instead (the replicas stepped, the caller updates once
    per iteration), it consumes the replicas' inf checks the same way.
    """
    context = replica_of_several()
    if not self._enabled:
        return _original_update(self, new_scale)
    if context is not None:
        context.merge_call(_update_once, args=(self, new_scale))
    elif _replica_states.get(self):  # no replica runs now: nothing else touches them
        _update_once(None, self, new_scale)
    else:
        _original_update(self, new_scale)
    return None


def _update_once(strategy: Any, scaler: Any, new_scale: Any) -> None:
    """In cross-replica context: one update from every replica's inf checks."""
    if isinstance(new_scale, PerReplica):
        new_scale = new_scale.values[0]
    states = _states_of(scaler)
    merged = {(replica_id, key): state
              for replica_id, per_optimizer in sorted(states.items()) for key, state in per_optimizer.items()}
    states.clear()
    scaler.__dict__[_STATE_NAME] = merged
    _original_update(scaler, new_scale)  # ends with fresh per-optimizer states


def _install() -> None:
    cls = torch_grad_scaler.GradScaler
    setattr(cls, _STATE_NAME, property(_get_states, _set_states))
    cls.step = _step  # type: ignore[method-assign]
    cls.update = _update  # type: ignore[method-assign]


install_grad_scaler_replicas = Interposition(
    "GradScaler.step/update and a per-replica state property", "torch.amp.GradScaler (the class)",
    "one scaler in a multi-replica step unscales and checks every replica's gradients and updates once",
    _install)
