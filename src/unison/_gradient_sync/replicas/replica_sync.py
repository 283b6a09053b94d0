"""Gradient synchronisation between the replica threads of one worker: when the replicas merge.

Each replica thread runs ``loss.backward()`` on its own components. When a replica's
backward pass ends (an autograd engine callback, queued by a hook on the first
gradient that arrives) it joins a merge: once every replica's backward ended, the
gradients are reduced across replicas and written back to every component
(``ReplicaGradientMerge``, ``replica_merge.py``). Gradients set without a backward pass
are reduced at ``opt.step()`` instead. Each replica then steps its own components with
its own optimizer (``ReplicaOptimizers``, ``replica_optimizers.py``).

Each replica's per-step state (inside ``no_sync``, reduction queued, gradients
reduced) is this object's, kept per replica context; the variables learn that a step
writes each replica's own component from ``STATE.own_component_writes``. Of a replica's
context this module uses only what ``ReplicaMeeting`` names; the merges it asks for
get the strategy as their first argument (``merge_call``'s rule) and leave it unused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import typing
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch

from unison._collectives.ops.base import CrossDeviceOps
from unison._collectives.ops.in_place_reduction import InPlaceReduction
from unison._devices import is_cuda
from unison._gradient_sync.replicas.replica_merge import ReplicaGradientMerge
from unison._gradient_sync.replicas.replica_optimizers import ReplicaOptimizers
from unison._gradient_sync.waiting_parameters import DormantParameters
from unison._interpose.torch_private import current_graph_task_id, queue_end_of_backward
from unison._reduce import ReduceOp
from unison._state import STATE
from unison._values.storage import MIRRORED, VariableStorage
from unison._values.variables import DistributedVariable
from unison.errors import GradientSyncError

__all__ = ["ReplicaGradientSync", "ReplicaMeeting"]


class ReplicaMeeting(Protocol):
    """What the replica synchroniser uses of a replica's context (``unison.ReplicaContext`` has it)."""

    @property
    def local_replica_id(self) -> int:
        """The replica's index among this worker's replicas."""
        ...

    def merge_call(self, merge_fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None) -> Any:
        """Runs ``merge_fn(strategy, *args)`` once, when every replica called it."""
        ...


@dataclasses.dataclass
class _ReplicaStepState:
    no_sync: int = 0  # > 0 inside strategy.extended.no_sync(): backward passes do not reduce
    backward_sync_queued: bool = False  # an end-of-backward reduction is queued
    grads_reduced: bool = False  # a backward pass reduced the gradients since the last step




@typing.final
class _ReplicaGradHook:
    """The post-accumulate-grad hook on one replica's components.

    Only a backward pass's first gradient has something to decide (whether this backward
    reduces, and queueing that). The hook remembers the backward pass (autograd's graph
    task, per thread) it decided for and returns at once for the rest, since a full call
    into Python per gradient adds up, with the other replica contending for the GIL
    (``benchmarks/RESULTS.md``, 'Replica gradient hook returns early').
    """

    __slots__ = ("_sync", "settled_task")

    def __init__(self, sync: ReplicaGradientSync):
        self._sync = sync
        self.settled_task = -1  # the graph task whose first gradient decided

    def __call__(self, tensor: torch.Tensor) -> None:
        if self.settled_task == current_graph_task_id() != -1:
            return
        self._sync._on_grad(self)


@typing.final
class ReplicaGradientSync:
    """Aggregates gradients across this worker's replica threads.

    CPU replicas reduce when their backward pass ends (code between ``backward()`` and
    ``opt.step()`` sees reduced gradients, as under DDP); with a replica on a GPU, the
    gradients are reduced when ``opt.step()`` begins.

    Args:
        owner: the strategy whose replicas this serves, only compared (by identity, with
            the strategy of the thread's context entry) to ignore other strategies'
            replicas; its class names it in errors.
        devices: the replica devices.
        cross_device_ops: reduces the gradients (across workers too, for a multi-worker
            strategy with several local devices).
        reduce_op: returns the current gradient ReduceOp (MEAN or SUM).
        storage: where the variables keep their components; under central storage only
            replica 0 steps.
        across_workers: ``cross_device_ops`` also reduces across workers (a multi-worker
            strategy with several local devices): every worker then reduces every
            variable, since a gradient this worker lacks may exist on another.
    """

    def __init__(self, owner: object, devices: Sequence[str], cross_device_ops: CrossDeviceOps,
                 reduce_op: Callable[[], ReduceOp], *, storage: VariableStorage = MIRRORED,
                 across_workers: bool = False):
        self._owner = weakref.ref(owner)
        self._owner_name = type(owner).__name__
        self._devices = tuple(devices)
        self._num_replicas = len(self._devices)
        self._storage = storage
        self._merge = ReplicaGradientMerge(self._devices, cross_device_ops, reduce_op, storage=storage,
                                           across_workers=across_workers)
        self._optimizers = ReplicaOptimizers(self._num_replicas, storage=storage, replica_of=self._replica_id)
        self._variables: list[weakref.ref[DistributedVariable]] = []
        self._dormant = DormantParameters()  # made frozen: registered once trainable
        self._registrations = 0  # with the live count, identifies the variables to the buffers
        self._no_sync_outside_run = 0
        self._states: weakref.WeakKeyDictionary[ReplicaMeeting, _ReplicaStepState] = weakref.WeakKeyDictionary()
        self._grad_hooks = [_ReplicaGradHook(self) for _ in self._devices]  # one per replica, on its components
        # Autograd runs a GPU's backward on its own device thread, outside the replica's
        # context, where the hooks cannot tell whose backward ends: with any replica on a
        # GPU, every replica reduces when its step begins (pre_step), all the same way.
        self._reduce_in_backward = not any(is_cuda(d) for d in self._devices)

    @property
    def merge(self) -> ReplicaGradientMerge:
        """The part that gathers, reduces and writes back the replicas' gradients."""
        return self._merge

    @property
    def optimizers(self) -> ReplicaOptimizers:
        """The part that steps each replica's components with its own optimizer."""
        return self._optimizers

    def _state(self, context: ReplicaMeeting) -> _ReplicaStepState:
        state = self._states.get(context)
        if state is None:
            state = self._states[context] = _ReplicaStepState()
        return state

    def _current_context(self) -> ReplicaMeeting | None:
        entry = STATE.top()
        if entry is None or entry.strategy is not self._owner():
            return None
        context: ReplicaMeeting | None = entry.replica_context  # None in cross-replica context
        return context

    def register(self, param: torch.Tensor) -> None:
        """Watches a trainable variable's components so their backward ends in a reduction.

        A variable made frozen (``nn.Parameter(t, requires_grad=False)``) waits aside
        until a backward finds it trainable (see ``_take_woken``): reducing it before
        would cost every step, and never reducing it let the replicas drift apart once
        it was unfrozen.
        """
        if not isinstance(param, DistributedVariable):
            return
        if not param.requires_grad:
            self._dormant.add(param)
            return
        variable = param
        self._variables.append(weakref.ref(variable))
        self._registrations += 1
        if not self._reduce_in_backward:
            return
        for replica_id in range(self._num_replicas):
            with torch._C.DisableTorchFunctionSubclass():
                torch.Tensor.register_post_accumulate_grad_hook(variable.component(replica_id),
                                                                self._grad_hooks[replica_id])

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside (of this replica, or of every replica when entered outside
        ``run``) only accumulate; the next backward outside reduces the accumulated sum."""
        context = self._current_context()
        state = self._state(context) if context is not None else None
        if state is None:
            self._no_sync_outside_run += 1
        else:
            state.no_sync += 1
        try:
            yield
        finally:
            if state is None:
                self._no_sync_outside_run -= 1
            else:
                state.no_sync -= 1

    @property
    def overlap_bucket_bytes(self) -> None:
        """None: the replicas' gradients are reduced when each replica's backward ends."""
        return None

    def finalize(self) -> None:
        """Nothing to prepare: gradients are reduced through merge_call as they come."""

    def _on_grad(self, hook: _ReplicaGradHook) -> None:
        context = self._current_context()
        if context is None or self._no_sync_outside_run:
            return
        state = self._state(context)
        hook.settled_task = current_graph_task_id()  # decided for this backward pass, whichever way
        if state.no_sync or state.backward_sync_queued:
            return
        state.backward_sync_queued = True
        if self._merge.buffers is not None:
            variables = self._live_variables()
            self._merge.install_buffers(context.local_replica_id, variables, (self._registrations, len(variables)))
        queue_end_of_backward(lambda: self._end_of_backward(context, state))

    def _live_variables(self) -> list[DistributedVariable]:
        return [v for ref in self._variables if (v := ref()) is not None]

    def _end_of_backward(self, context: ReplicaMeeting, state: _ReplicaStepState) -> None:
        state.backward_sync_queued = False
        reduction = context.merge_call(self._merge_registered, args=(self._live_variables(),))
        if reduction is not None:  # large gradients: every replica reduces its slice (in_place_reduction.py)
            reduction.run(context.local_replica_id)
            context.merge_call(_every_slice_reduced)
        state.grads_reduced = True

    def _merge_registered(self, _strategy: object, variables: list) -> InPlaceReduction | None:
        """In a merge: reduces every live registered variable's gradients, and those of
        variables made frozen that are trainable now (``_take_woken``)."""
        key = (self._registrations, len(variables))  # before _take_woken registers more
        woken = self._take_woken() if self._dormant else []
        return self._merge.reduce_registered(variables, key, woken)

    def _merge_params(self, _strategy: object, params: list) -> None:
        """In a merge: reduces the gradients of ``params`` (an optimizer's) no backward pass reduced."""
        self._merge.reduce(params)

    def _replica_id(self) -> int | None:
        context = self._current_context()
        return None if context is None else context.local_replica_id

    def _context(self) -> ReplicaMeeting:
        context = self._current_context()
        if context is None:
            raise GradientSyncError(
                f"opt.step() on a model of {self._owner_name} with {self._num_replicas} "
                f"local replicas must run inside strategy.run(step_fn): each replica thread computes its "
                f"own gradients and the step aggregates them; move backward() and step() into step_fn"
            )
        return context

    def pre_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> Any:
        """Reduces gradients no backward pass reduced, then points replica ``i`` at its own optimizer."""
        context = self._context()
        state = self._state(context)
        if state.no_sync or self._no_sync_outside_run:
            raise GradientSyncError(
                "opt.step() inside `no_sync()`: the accumulated gradients were never reduced across "
                "replicas; leave no_sync() for the last micro-batch's backward, then step"
            )
        if not state.grads_reduced:  # gradients that no backward pass of this run produced
            params = [p for group in optimizer.param_groups for p in group["params"]]
            context.merge_call(self._merge_params, args=(params,))
        state.grads_reduced = False
        STATE.own_component_writes.begin()
        return (self._optimizers.for_replica(optimizer, context.local_replica_id), *args[1:]), kwargs

    def post_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Ends the step's writes to this replica's own components; with central storage, waits
        until replica 0 has stepped the one copy every replica reads.

        Without that wait, a replica whose (empty) step returned first would go on reading
        the variables while replica 0 writes them: a GAN's discriminator step saw the
        generator before its update (0.01 off with Adam, a whole step's change).
        """
        STATE.own_component_writes.end()
        if not self._storage.replicas_step:
            self._context().merge_call(_stepped)

    def _take_woken(self) -> list[torch.Tensor]:
        """Variables made frozen that are trainable now (unfrozen in or before this step):
        registered from here on, and returned so that this step reduces them too. In a merge."""
        woken = self._dormant.take_trainable()
        for variable in woken:
            self.register(variable)
        return woken


def _stepped(_strategy: object) -> None:
    """The merge after a central-storage optimizer step: every replica has returned from it."""


def _every_slice_reduced(_strategy: object) -> None:
    """The merge after the replicas reduced their slices: none reads its gradients before all are written."""
