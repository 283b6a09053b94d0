"""Optimizer integration: plain ``backward()`` and ``opt.step()`` under several local replicas.

Each replica thread runs ``loss.backward()`` on its own components. When a replica's
backward pass ends (an autograd engine callback, queued by a hook on the first
gradient that arrives) it joins a merge: once every replica's backward ended, the
gradients of each variable are reduced across replicas (mean by default,
``strategy.extended.gradient_reduce_op``) and written back to every component — so
code between ``backward()`` and ``opt.step()`` (gradient clipping) sees reduced
gradients, as with DDP. Gradients set without a backward pass are reduced at
``opt.step()`` instead. Replica 0 then runs the user's optimizer on component 0 (so its state and
``state_dict()`` are the user's); replica ``i`` runs a shadow copy of the optimizer
over component ``i`` with its own per-device state and the user's current
hyperparameters (learning-rate schedulers keep working). Under central storage only
replica 0 steps, since all replicas share one storage.
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from collections import OrderedDict, defaultdict
from typing import Any, Iterator, cast

import torch

from unison._state import STATE
from unison.values.values import Mirrored, PerReplica
from unison.values.variables import DistributedVariable

__all__ = ["ReplicaGradientSync"]


class ReplicaGradientSync:
    """Aggregates gradients across this worker's replica threads at ``opt.step()``."""

    def __init__(self, strategy: Any, num_replicas: int, *, central: bool = False):
        self._strategy_ref = weakref.ref(strategy)
        self._num_replicas = num_replicas
        self._central = central
        self._shadows: "weakref.WeakKeyDictionary[torch.optim.Optimizer, list]" = weakref.WeakKeyDictionary()
        self._variables: list["weakref.ref[DistributedVariable]"] = []
        self._no_sync_outside_run = 0

    def register(self, variable: DistributedVariable) -> None:
        """Watches a trainable variable's components so their backward ends in a reduction."""
        if not cast(torch.Tensor, variable).requires_grad:
            return
        self._variables.append(weakref.ref(variable))
        for replica_id in range(self._num_replicas):
            with torch._C.DisableTorchFunctionSubclass():
                torch.Tensor.register_post_accumulate_grad_hook(variable._component(replica_id), self._on_grad)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside (of this replica, or of every replica when entered outside
        ``run``) only accumulate; the next backward outside reduces the accumulated sum."""
        entry = STATE.top()
        context = entry.replica_context if entry is not None else None
        if context is None:
            self._no_sync_outside_run += 1
        else:
            context._no_sync += 1
        try:
            yield
        finally:
            if context is None:
                self._no_sync_outside_run -= 1
            else:
                context._no_sync -= 1

    def _on_grad(self, tensor: torch.Tensor) -> None:
        entry = STATE.top()
        context = entry.replica_context if entry is not None else None
        if (context is None or context.strategy is not self._strategy_ref() or context._no_sync
                or self._no_sync_outside_run or context._backward_sync_queued):
            return
        context._backward_sync_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(lambda: self._end_of_backward(context))

    def _end_of_backward(self, context: Any) -> None:
        context._backward_sync_queued = False
        params = [v for v in (ref() for ref in self._variables) if v is not None]
        context.merge_call(self._aggregate, args=(params,))
        context._grads_reduced = True

    def _context(self) -> Any:
        entry = STATE.top()
        context = entry.replica_context if entry is not None else None
        if context is None or context.strategy is not self._strategy_ref():
            raise RuntimeError(
                f"opt.step() on a model of {type(self._strategy_ref()).__name__} with {self._num_replicas} "
                f"local replicas must run inside strategy.run(step_fn): each replica thread computes its "
                f"own gradients and the step aggregates them; move backward() and step() into step_fn"
            )
        return context

    def pre_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> Any:
        context = self._context()
        if context._no_sync or self._no_sync_outside_run:
            raise RuntimeError(
                "opt.step() inside `no_sync()`: the accumulated gradients were never reduced across "
                "replicas; leave no_sync() for the last micro-batch's backward, then step"
            )
        if not context._grads_reduced:  # gradients that no backward pass of this run produced
            params = [p for group in optimizer.param_groups for p in group["params"]]
            context.merge_call(self._aggregate, args=(params,))
        context._grads_reduced = False
        context._local_writes = 1
        replica_id = context._local_replica_id
        if replica_id == 0:
            return None
        return (self._shadow(optimizer, replica_id), *args[1:]), kwargs

    def post_step(self, optimizer: torch.optim.Optimizer) -> None:
        entry = STATE.top()
        if entry is not None and entry.replica_context is not None:
            entry.replica_context._local_writes = 0

    def _aggregate(self, strategy: Any, params: list) -> None:
        devices = strategy.extended.worker_devices
        targets, pairs = [], []
        for param in params:
            if not isinstance(param, DistributedVariable):
                continue
            grads = [param._component_grad(i) for i in range(self._num_replicas)]
            if all(g is None for g in grads):
                continue
            grads = [
                g if g is not None else torch.zeros_like(param._component(i).detach())
                for i, g in enumerate(grads)
            ]
            targets.append(param)
            pairs.append((PerReplica(grads), devices))
        if not pairs:
            return
        reduced = strategy.extended.cross_device_ops.batch_reduce(strategy.extended.gradient_reduce_op, pairs)
        for param, result in zip(targets, reduced):
            components = result.values if isinstance(result, Mirrored) else (result,)
            for i in range(self._num_replicas):
                param._set_component_grad(i, components[i])

    def _shadow(self, optimizer: torch.optim.Optimizer, replica_id: int) -> torch.optim.Optimizer:
        shadows = self._shadows.get(optimizer)
        if shadows is None:
            shadows = [self._make_shadow(optimizer, i) for i in range(1, self._num_replicas)]
            self._shadows[optimizer] = shadows
        shadow = shadows[replica_id - 1]
        for shadow_group, group in zip(shadow.param_groups, optimizer.param_groups):
            for key, value in group.items():
                if key != "params":
                    shadow_group[key] = value
        return shadow

    def _make_shadow(self, optimizer: torch.optim.Optimizer, replica_id: int) -> torch.optim.Optimizer:
        shadow = copy.copy(optimizer)
        shadow.state = defaultdict(dict)
        shadow._optimizer_step_pre_hooks = OrderedDict()
        shadow._optimizer_step_post_hooks = OrderedDict()
        shadow.param_groups = [] if self._central else [
            {**group, "params": [p._component(replica_id) for p in group["params"] if isinstance(p, DistributedVariable)]}
            for group in optimizer.param_groups
        ]
        return shadow
