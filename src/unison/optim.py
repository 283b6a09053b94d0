"""Optimizer integration: plain ``opt.step()`` under several local replicas.

Each replica thread runs ``loss.backward()`` on its own components, then calls
``opt.step()``. The step pre-hook makes that call a merge point: once every replica
arrived, the gradients of each variable are reduced across replicas (mean by
default, ``strategy.extended.gradient_reduce_op``) and written back to every
component. Replica 0 then runs the user's optimizer on component 0 (so its state and
``state_dict()`` are the user's); replica ``i`` runs a shadow copy of the optimizer
over component ``i`` with its own per-device state and the user's current
hyperparameters (learning-rate schedulers keep working). Under central storage only
replica 0 steps, since all replicas share one storage.
"""

from __future__ import annotations

import copy
import weakref
from collections import OrderedDict, defaultdict
from typing import Any

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
        context.merge_call(self._aggregate, args=(optimizer,))
        context._local_writes = 1
        replica_id = context._local_replica_id
        if replica_id == 0:
            return None
        return (self._shadow(optimizer, replica_id), *args[1:]), kwargs

    def post_step(self, optimizer: torch.optim.Optimizer) -> None:
        entry = STATE.top()
        if entry is not None and entry.replica_context is not None:
            entry.replica_context._local_writes = 0

    def _aggregate(self, strategy: Any, optimizer: torch.optim.Optimizer) -> None:
        devices = strategy.extended.worker_devices
        targets, pairs = [], []
        for group in optimizer.param_groups:
            for param in group["params"]:
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
