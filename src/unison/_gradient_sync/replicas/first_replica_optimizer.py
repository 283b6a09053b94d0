"""Replica 0's optimizer step over plain tensors, with the user's optimizer state.

Replica ``i > 0`` steps a shadow copy of the user's optimizer over its plain component
tensors. Replica 0's components are plain too (a MirroredVariable's component 0 is a
leaf alias of it), but the user's optimizer holds the variables, tensor subclasses:
stepping it would send every ``p.grad`` read and every in-place update through
``__torch_function__`` (four to eight dispatches per parameter per step,
microseconds each: a large share of a small model's step). ``PrimaryShadow`` steps a
shadow over the components instead, where autograd left replica 0's gradients, whose
``state`` is the user's optimizer's state keyed by the variables, so
``optimizer.state_dict()``, checkpoints and schedulers see what they would have seen.
"""

from __future__ import annotations

import operator
import typing
from collections.abc import Iterator, MutableMapping
from typing import Any

import torch

from unison._gradient_sync.replicas.shadow_optimizers import follow_hyperparameters, shadow_optimizer
from unison._values.variables import DistributedVariable

__all__ = ["PrimaryShadow"]


@typing.final
class _StateOfVariables(MutableMapping):
    """The user's optimizer state, looked up by component: ``state[component]`` is ``state[variable]``."""

    def __init__(self, state: Any, variable_of: dict[torch.Tensor, torch.Tensor]):
        self._state = state
        self._variable_of = variable_of

    def __getitem__(self, key: Any) -> Any:
        return self._state[self._variable_of.get(key, key)]  # a defaultdict: makes the entry

    def __setitem__(self, key: Any, value: Any) -> None:
        self._state[self._variable_of.get(key, key)] = value

    def __delitem__(self, key: Any) -> None:
        del self._state[self._variable_of.get(key, key)]

    def __contains__(self, key: object) -> bool:
        return self._variable_of.get(key, key) in self._state  # type: ignore[call-overload]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._state)

    def __len__(self) -> int:
        return len(self._state)


@typing.final
class PrimaryShadow:
    """Replica 0's step optimizer for one user optimizer: plain components, shared state."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self._params: list[torch.Tensor] = []
        self._state: Any = None
        self._shadow = self._build(optimizer)

    def _build(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        variable_of: dict[torch.Tensor, torch.Tensor] = {}
        groups = []
        for group in optimizer.param_groups:
            components = []
            for param in group["params"]:
                component = param
                if isinstance(param, DistributedVariable):
                    component = param.component(0)
                    variable_of[component] = typing.cast(torch.Tensor, param)  # a tensor subclass, not typed as one
                components.append(component)
            groups.append({**group, "params": components})
        self._params = _params_of(optimizer)
        self._state = optimizer.state
        return shadow_optimizer(optimizer, groups, _StateOfVariables(optimizer.state, variable_of))

    def _current(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether the shadow still stands for the optimizer's parameters (a variable's
        component 0 is made with it and never replaced) and its state is still the
        optimizer's (``load_state_dict`` replaces it)."""
        if self._state is not optimizer.state:
            return False
        params = _params_of(optimizer)
        return len(params) == len(self._params) and all(map(operator.is_, params, self._params))  # C-level: every step

    def for_step(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The shadow to step now, with the user's current hyperparameters (learning-rate
        schedulers keep working)."""
        if not self._current(optimizer):
            self._shadow = self._build(optimizer)
        follow_hyperparameters(self._shadow, optimizer)
        return self._shadow


def _params_of(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [param for group in optimizer.param_groups for param in group["params"]]
