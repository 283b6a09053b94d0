"""Gradient synchronisation between the replica threads of one worker.

Each replica thread runs ``loss.backward()`` on its own components. When a replica's
backward pass ends (an autograd engine callback, queued by a hook on the first
gradient that arrives) it joins a merge: once every replica's backward ended, the
gradients of each variable are reduced across replicas (mean by default,
``strategy.extended.gradient_reduce_op``) and written back to every component — so
code between ``backward()`` and ``opt.step()`` (gradient clipping) sees reduced
gradients, as with DDP. Gradients set without a backward pass are reduced at
``opt.step()`` instead. Replica 0 then steps component 0 with the user's optimizer
state (``PrimaryShadow``: its ``state_dict()`` is the user's); replica ``i`` runs a shadow copy of the optimizer
over component ``i`` with its own per-device state and the user's current
hyperparameters (learning-rate schedulers keep working). Under central storage only
replica 0 steps, since all replicas share one storage.

Each replica's per-step state (inside ``no_sync``, reduction queued, gradients
reduced) is this object's, kept per replica context; the variables learn that a step
writes each replica's own component from ``STATE.own_component_writes``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import typing
import weakref
from collections import defaultdict
from typing import Any, Callable, Iterator, Sequence

import torch

from unison._state import STATE
from unison.collectives.base import CrossDeviceOps
from unison.collectives.local import ReductionToOneDevice
from unison.devices import is_cuda
from unison.context import ReplicaContext
from unison.errors import GradientSyncError
from unison.gradient_sync.dormant import DormantParameters
from unison.gradient_sync.primary_shadow import PrimaryShadow
from unison.gradient_sync.replica_grad_buffers import ReplicaGradBuffers
from unison.gradient_sync.replica_reduction import InPlaceReduction
from unison.gradient_sync.replica_zero_grad import install_replica_zero_grad
from unison.gradient_sync.shadow_optimizers import follow_hyperparameters, shadow_optimizer
from unison.reduce import ReduceOp
from unison.values.storage import MIRRORED, VariableStorage
from unison.values.values import Mirrored, PerReplica
from unison.values.variables import DistributedVariable

__all__ = ["ReplicaGradientSync"]


@dataclasses.dataclass
class _ReplicaStepState:
    no_sync: int = 0  # > 0 inside strategy.extended.no_sync(): backward passes do not reduce
    backward_sync_queued: bool = False  # an end-of-backward reduction is queued
    grads_reduced: bool = False  # a backward pass reduced the gradients since the last step


_current_graph_task_id = torch._C._current_graph_task_id


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

    def __init__(self, sync: "ReplicaGradientSync"):
        self._sync = sync
        self.settled_task = -1  # the graph task whose first gradient decided

    def __call__(self, tensor: torch.Tensor) -> None:
        if self.settled_task == _current_graph_task_id() != -1:
            return
        self._sync._on_grad(self)


@typing.final
class ReplicaGradientSync:
    """Aggregates gradients across this worker's replica threads.

    CPU replicas reduce when their backward pass ends (code between ``backward()`` and
    ``opt.step()`` sees reduced gradients, as under DDP); with a replica on a GPU, the
    gradients are reduced when ``opt.step()`` begins.

    Args:
        owner: the strategy whose replicas this serves (only compared, to ignore other
            strategies' replicas).
        devices: the replica devices.
        cross_device_ops: reduces the gradients (across workers too, for a multi-worker
            strategy with several local devices).
        reduce_op: returns the current gradient ReduceOp (MEAN or SUM).
        storage: where the variables keep their components; under central storage only
            replica 0 steps.
        across_workers: ``cross_device_ops`` also reduces across workers (a multi-worker
            strategy with several local devices): every worker then reduces every
            variable, since a gradient this worker lacks may exist on another (see
            ``_aggregate``).
    """

    def __init__(self, owner: Any, devices: Sequence[str], cross_device_ops: CrossDeviceOps,
                 reduce_op: Callable[[], ReduceOp], *, storage: VariableStorage = MIRRORED,
                 across_workers: bool = False):
        self._owner = weakref.ref(owner)
        self._devices = tuple(devices)
        self._num_replicas = len(self._devices)
        self._cross_device_ops = cross_device_ops
        self._reduce_op = reduce_op
        self._storage = storage
        self._across_workers = across_workers
        self._shadows: "weakref.WeakKeyDictionary[torch.optim.Optimizer, list]" = weakref.WeakKeyDictionary()
        self._shadows_lock = threading.Lock()
        self._watched: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()  # load_state_dict hooked
        # replica 0 steps the variables' plain components 0 with the user's state (primary_shadow.py)
        self._primaries: "weakref.WeakKeyDictionary[torch.optim.Optimizer, PrimaryShadow]" = weakref.WeakKeyDictionary()
        self._variables: list["weakref.ref[DistributedVariable]"] = []
        self._dormant = DormantParameters()  # made frozen: registered once trainable
        self._registrations = 0  # with the live count, identifies the variables to the buffers
        self._no_sync_outside_run = 0
        self._states: "weakref.WeakKeyDictionary[ReplicaContext, _ReplicaStepState]" = weakref.WeakKeyDictionary()
        self._grad_hooks = [_ReplicaGradHook(self) for _ in self._devices]  # one per replica, on its components
        # Autograd runs a GPU's backward on its own device thread, outside the replica's
        # context, where the hooks cannot tell whose backward ends: with any replica on a
        # GPU, every replica reduces when its step begins (pre_step), all the same way.
        self._reduce_in_backward = not any(is_cuda(d) for d in self._devices)
        # CPU replicas with their own storage and the default reduction: the gradients are
        # reduced in place (see _aggregate_in_place); anything else goes through the ops.
        self._in_place = (type(cross_device_ops) is ReductionToOneDevice and cross_device_ops.accumulation_fn is None
                          and cross_device_ops.reduce_to_device in (None, *self._devices)
                          and storage is MIRRORED and not any(is_cuda(d) for d in self._devices))
        # ... and their gradients live in one flat buffer per replica and dtype (replica_grad_buffers.py)
        self._buffers = ReplicaGradBuffers(self._num_replicas) if self._in_place else None

    def _state(self, context: ReplicaContext) -> _ReplicaStepState:
        state = self._states.get(context)
        if state is None:
            state = self._states[context] = _ReplicaStepState()
        return state

    def _current_context(self) -> "ReplicaContext | None":
        entry = STATE.top()
        context = entry.replica_context if entry is not None else None
        return context if context is not None and context.strategy is self._owner() else None

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

    def _on_grad(self, hook: "_ReplicaGradHook") -> None:
        context = self._current_context()
        if context is None or self._no_sync_outside_run:
            return
        state = self._state(context)
        hook.settled_task = _current_graph_task_id()  # decided for this backward pass, whichever way
        if state.no_sync or state.backward_sync_queued:
            return
        state.backward_sync_queued = True
        if self._buffers is not None:
            variables = self._live_variables()
            self._buffers.install(context.local_replica_id, variables, (self._registrations, len(variables)))
        torch.autograd.Variable._execution_engine.queue_callback(lambda: self._end_of_backward(context, state))

    def _live_variables(self) -> list[DistributedVariable]:
        return [v for ref in self._variables if (v := ref()) is not None]

    def _end_of_backward(self, context: ReplicaContext, state: _ReplicaStepState) -> None:
        state.backward_sync_queued = False
        reduction = context.merge_call(self._aggregate_registered, args=(self._live_variables(),))
        if reduction is not None:  # large gradients: every replica reduces its slice (replica_reduction.py)
            reduction.run(context.local_replica_id)
            context.merge_call(_every_slice_reduced)
        state.grads_reduced = True

    def _replica_id(self) -> "int | None":
        context = self._current_context()
        return None if context is None else context.local_replica_id

    def _context(self) -> ReplicaContext:
        context = self._current_context()
        if context is None:
            raise GradientSyncError(
                f"opt.step() on a model of {type(self._owner()).__name__} with {self._num_replicas} "
                f"local replicas must run inside strategy.run(step_fn): each replica thread computes its "
                f"own gradients and the step aggregates them; move backward() and step() into step_fn"
            )
        return context

    def pre_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> Any:
        """Reduces gradients no backward pass reduced, then points replica ``i`` at its shadow optimizer."""
        context = self._context()
        state = self._state(context)
        if state.no_sync or self._no_sync_outside_run:
            raise GradientSyncError(
                "opt.step() inside `no_sync()`: the accumulated gradients were never reduced across "
                "replicas; leave no_sync() for the last micro-batch's backward, then step"
            )
        if not state.grads_reduced:  # gradients that no backward pass of this run produced
            params = [p for group in optimizer.param_groups for p in group["params"]]
            context.merge_call(self._aggregate, args=(params,))
        state.grads_reduced = False
        STATE.own_component_writes.begin()
        replica_id = context.local_replica_id
        if replica_id == 0:
            # the other replicas' shadows copy the user's state when made: make them before
            # replica 0's step changes it (they are made once, and again after a load_state_dict)
            self._shadows_of(optimizer)
            primary = self._primaries.get(optimizer)
            if primary is None:
                primary = self._primaries[optimizer] = PrimaryShadow(optimizer)
            return (primary.for_step(optimizer), *args[1:]), kwargs
        return (self._shadow(optimizer, replica_id), *args[1:]), kwargs

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

    def _aggregate_registered(self, strategy: Any, variables: list) -> "InPlaceReduction | None":
        """Reduces the gradients of every live registered variable (``_live_variables()``):
        those in the replicas' flat buffers there, the others through ``_aggregate``.

        Reductions in place are collected and run here, or, when they are large, returned
        for every replica to run its slice of after the merge."""
        reduction = InPlaceReduction(self._num_replicas, self._reduce_op() is ReduceOp.MEAN) if self._in_place else None
        if self._buffers is not None:
            rest = self._buffers.reduce(variables, (self._registrations, len(variables)),
                                        self._reduce_op() is ReduceOp.MEAN, reduction)
            if rest is not None:
                variables = rest  # the variables the buffers do not hold (large gradients)
        woken = self._take_woken() if self._dormant else []
        self._aggregate(strategy, [*variables, *woken] if woken else variables, reduction)
        if reduction is None or reduction.split:
            return reduction
        reduction.run()
        return None

    def _take_woken(self) -> list[torch.Tensor]:
        """Variables made frozen that are trainable now (unfrozen in or before this step):
        registered from here on, and returned so that this step reduces them too. In a merge."""
        woken = self._dormant.take_trainable()
        for variable in woken:
            self.register(variable)
        return woken

    def _aggregate(self, strategy: Any, params: list, reduction: "InPlaceReduction | None" = None) -> None:
        """Reduces the variables' gradients across replicas (and workers); those reduced in
        place join ``reduction`` when one is given.

        A variable no local replica has a gradient for is left alone, unless the reduction
        spans workers: then another worker may have one, and every worker must reduce the
        same tensors, so its gradients go as zeros, with a flag per variable and replica
        (1 where a gradient existed) reduced in the same call. A variable whose flags sum
        to zero had a gradient nowhere and keeps none, as on one device.
        """
        devices = self._devices
        n = self._num_replicas
        across = self._across_workers
        targets: list[DistributedVariable] = []
        per_param: list[tuple[torch.Tensor, ...]] = []
        made: list[int] = []
        nowhere_here: list[int] = []  # across workers: targets no local replica had a gradient for
        present: list[list[float]] = [[] for _ in range(n)]
        # One subclass-dispatch switch for the whole walk (not one per component): this
        # runs every step, on every variable.
        with torch._C.DisableTorchFunctionSubclass():
            variables = [p for p in params if isinstance(p, DistributedVariable)]
            # the gradients replica by replica, then variable by variable (list comprehensions:
            # a third of the Python time of a loop per variable, on 400 variables)
            by_replica = [[v.component(i).grad for v in variables] for i in range(n)]
            missing = {k for grads in by_replica for k, g in enumerate(grads) if g is None}
            for k, maybe_grads in enumerate(zip(*by_replica)):
                if across:
                    for i, g in enumerate(maybe_grads):
                        present[i].append(0.0 if g is None else 1.0)
                if k in missing:
                    if all(g is None for g in maybe_grads):
                        if not across:
                            continue
                        nowhere_here.append(len(targets))
                    made.append(len(targets))
                    param = variables[k]
                    maybe_grads = tuple(g if g is not None else torch.zeros_like(param.component(i).detach())
                                        for i, g in enumerate(maybe_grads))
                targets.append(variables[k])
                per_param.append(maybe_grads)
        if not targets:
            return
        if self._in_place and self._aggregate_in_place(per_param, reduction):
            for k in made:  # gradients made as zeros above become the components'
                for i, grad in enumerate(per_param[k]):
                    if targets[k].component_grad(i) is not grad:
                        targets[k].set_component_grad(i, grad)
            return
        pairs = [(PerReplica(grads), devices) for grads in per_param]
        if across:  # the same on every worker: the flags go whether or not this one needs them
            flags = [torch.tensor(present[i], dtype=torch.float32, device=devices[i]) for i in range(n)]
            pairs.append((PerReplica(flags), devices))
        reduced = self._cross_device_ops.batch_reduce(self._reduce_op(), pairs)
        nowhere: set[int] = set()
        if across:
            summed = reduced.pop()
            if nowhere_here:  # read only when needed: on a GPU the read waits for the reduction
                sums = (summed.values[0] if isinstance(summed, Mirrored) else summed).tolist()
                nowhere = {t for t in nowhere_here if sums[t] == 0}
        for t, (param, result) in enumerate(zip(targets, reduced)):
            if t in nowhere:
                continue  # no replica of any worker had a gradient: none, as on one device
            reduced_grads = result.values if isinstance(result, Mirrored) else (result,)
            for i in range(self._num_replicas):
                param.set_component_grad(i, reduced_grads[i])

    def _aggregate_in_place(self, per_param: list[tuple[torch.Tensor, ...]],
                            reduction: "InPlaceReduction | None" = None) -> bool:
        """Reduces CPU replicas' gradients into the gradients themselves; False if it cannot.

        The replicas share the host's memory, so there is nothing to move: replica 0's
        gradient becomes the sum (in replica order, as ReductionToOneDevice adds), is
        divided for MEAN, and is copied into the others' gradients -- three foreach calls
        whatever the number of parameters, no allocation, two passes fewer over the bytes
        than packing into new buffers (``replica_reduction.py``; as part of ``reduction``
        when one is given). Gradients that require grad (``create_graph``), are sparse or
        not floating point, or share a tensor, take the general path.
        """
        grads = [g for values in per_param for g in values]
        if any(g.requires_grad or g.layout != torch.strided or not g.is_cpu
               or not (g.is_floating_point() or g.is_complex()) for g in grads):
            return False
        if len({id(g) for g in grads}) != len(grads):
            return False
        here = reduction if reduction is not None else InPlaceReduction(self._num_replicas,
                                                                         self._reduce_op() is ReduceOp.MEAN)
        for values in per_param:
            here.add(values)
        if reduction is None:
            here.run()
        return True

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
                        install_replica_zero_grad(optimizer, self._replica_id)
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


def _stepped(strategy: Any) -> None:
    """The merge after a central-storage optimizer step: every replica has returned from it."""


def _every_slice_reduced(strategy: Any) -> None:
    """The merge after the replicas reduced their slices: none reads its gradients before all are written."""


@typing.final
class _ForgetShadows:
    """An optimizer's ``load_state_dict`` post-hook: its replica shadows are made again from the loaded state."""

    def __init__(self, sync: ReplicaGradientSync):
        self._sync = weakref.ref(sync)  # the hook must not keep the strategy's synchroniser alive

    def __call__(self, optimizer: torch.optim.Optimizer) -> None:
        sync = self._sync()
        if sync is not None:
            sync._forget_shadows(optimizer)


def _state_copy(state: dict, device: torch.device, to: torch.device) -> dict:
    """A copy of one parameter's optimizer state for a replica's component on ``to``.

    Tensors on the variable's own device (momentum buffers, Adam moments) are copied to
    ``to``; others (Adam's CPU ``step`` count) are copied where they are.
    """
    return {key: (value.detach().to(to if value.device == device else value.device, copy=True)
                  if isinstance(value, torch.Tensor) else value)
            for key, value in state.items()}
