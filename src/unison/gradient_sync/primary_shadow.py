"""Replica 0's optimizer step over plain tensors, with the user's optimizer state.

Replica ``i > 0`` steps a shadow copy of the user's optimizer over its plain component
tensors. Replica 0's component is the distributed variable itself, a tensor subclass:
stepping the user's optimizer over it sends every ``p.grad`` read and every in-place
update through ``__torch_function__`` (four to eight dispatches per parameter per
step, microseconds each: a large share of a small model's step). ``PrimaryShadow``
steps a shadow over plain aliases of the variables instead (``detach()``: the same
storage and version counter), whose ``state`` is the user's optimizer's state keyed
by the variables, so ``optimizer.state_dict()``, checkpoints and schedulers see what
they would have seen. The aliases are rebuilt when the optimizer's parameters change
or a variable's storage was replaced (``param.data = ...``).
"""

from __future__ import annotations

import operator
import typing
from collections.abc import MutableMapping
from typing import Any, Iterator

import torch

from unison.gradient_sync.grad_access import clear_grads, grads_of, set_grads
from unison.gradient_sync.shadow_optimizers import follow_hyperparameters, shadow_optimizer
from unison.values.variables import DistributedVariable

__all__ = ["PrimaryShadow"]

_data_ptr = torch._C.TensorBase.data_ptr


@typing.final
class _StateOfVariables(MutableMapping):
    """The user's optimizer state, looked up by alias: ``state[alias]`` is ``state[variable]``."""

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
    """Replica 0's step optimizer for one user optimizer: plain aliases, shared state."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self._variables: list[torch.Tensor] = []
        self._aliases: list[torch.Tensor] = []
        self._state: Any = None
        self._shadow = self._build(optimizer)

    def _build(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        variables: list[torch.Tensor] = []
        aliases: list[torch.Tensor] = []
        variable_of: dict[torch.Tensor, torch.Tensor] = {}
        groups = []
        with torch._C.DisableTorchFunctionSubclass():
            for group in optimizer.param_groups:
                params = []
                for param in group["params"]:
                    alias = param
                    if isinstance(param, DistributedVariable):
                        tensor = typing.cast(torch.Tensor, param)  # a tensor subclass, not typed as one
                        alias = tensor.detach().requires_grad_(tensor.requires_grad)
                        variable_of[alias] = tensor
                    variables.append(param)
                    aliases.append(alias)
                    params.append(alias)
                groups.append({**group, "params": params})
        self._variables, self._aliases = variables, aliases
        self._plain_aliases = [a for a, v in zip(aliases, variables) if a is not v]  # not the parameters themselves
        self._state = optimizer.state
        return shadow_optimizer(optimizer, groups, _StateOfVariables(optimizer.state, variable_of))

    def _current(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether the aliases still stand for the optimizer's parameters and their storage,
        and the shadow's state is still the optimizer's (``load_state_dict`` replaces it)."""
        if self._state is not optimizer.state:
            return False
        variables, aliases = self._variables, self._aliases
        params = [param for group in optimizer.param_groups for param in group["params"]]
        # C-level passes: this runs every step, over every parameter (a plain parameter is its own alias)
        return (len(params) == len(variables) and all(map(operator.is_, params, variables))
                and list(map(_data_ptr, aliases)) == list(map(_data_ptr, variables)))

    def for_step(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The shadow to step now: current aliases carrying the variables' gradients and the
        user's current hyperparameters (learning-rate schedulers keep working)."""
        with torch._C.DisableTorchFunctionSubclass():
            if not self._current(optimizer):
                self._shadow = self._build(optimizer)
            # a plain parameter is its own alias: setting its gradient to itself changes nothing
            set_grads(self._aliases, grads_of(self._variables))
        follow_hyperparameters(self._shadow, optimizer)
        return self._shadow

    def after_step(self) -> None:
        """Drops the aliases' references to the gradients (``zero_grad`` must be able to free them)."""
        with torch._C.DisableTorchFunctionSubclass():
            clear_grads(self._plain_aliases)
