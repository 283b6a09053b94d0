"""Variable policies: what a strategy makes of a new variable or module parameter."""

from __future__ import annotations

import typing
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from unison._devices import canonicalize, torch_device
from unison._gradient_sync.step_hooks import attach
from unison._values.aggregation import VariableAggregation, VariableSynchronization
from unison._values.storage import MIRRORED, VariableStorage
from unison._values.variables import DistributedVariable, MirroredVariable, SyncOnReadVariable

__all__ = ["PlainVariablePolicy", "ReplicatedVariablePolicy"]


def _plain(value: torch.Tensor, device: str, trainable: bool) -> torch.Tensor:
    tensor = value.detach().to(torch_device(device))
    return tensor.requires_grad_(trainable and tensor.is_floating_point())


@typing.final
class PlainVariablePolicy:
    """One replica on one device: variables and parameters stay plain tensors there.

    ``gradient_sync`` (multi-worker) is attached to parameters so ``opt.step()`` finds it;
    ``on_finish`` makes new variables equal across workers (the chief's values).
    """

    def __init__(self, device: str, gradient_sync: Any = None, on_finish: Callable[[list], None] | None = None):
        self._device = device
        self._gradient_sync = gradient_sync
        self._on_finish = on_finish

    def wrap_parameter(self, param: nn.Parameter, name: str) -> nn.Parameter | None:
        target = torch_device(self._device)
        replacement = None
        if param.device != target:
            replacement = nn.Parameter(param.detach().to(target), requires_grad=param.requires_grad)
        if self._gradient_sync is not None:
            chosen = replacement if replacement is not None else param
            attach(chosen, self._gradient_sync)
            self._gradient_sync.register(chosen)
        return replacement

    def wrap_buffer(self, buffer: torch.Tensor, name: str) -> torch.Tensor | None:
        """Buffers move to the device, like parameters."""
        target = torch_device(self._device)
        return buffer.to(target) if buffer.device != target else None

    def create(self, value: torch.Tensor, *, trainable: bool, name: str | None,
               synchronization: VariableSynchronization, aggregation: VariableAggregation) -> torch.Tensor:
        return _plain(value, self._device, trainable)

    def finish(self, variables: list) -> None:
        if self._on_finish is not None:
            self._on_finish(variables)

    def placement(self, variable: Any) -> str | list[str]:
        """The device of a plain variable."""
        if not isinstance(variable, torch.Tensor):
            raise ValueError(f"variable_placement takes a variable, got {type(variable).__name__}")
        return canonicalize(variable.device)


@typing.final
class ReplicatedVariablePolicy:
    """Several replicas (or a multi-worker strategy): distributed variables.

    Module parameters become MirroredVariables with the given ``storage`` (one copy per
    device, or one central copy) when there are several local replicas, and stay plain
    with one. ``unison.Variable`` always gives a distributed variable.
    """

    def __init__(self, strategy: Any, devices: Sequence[str], *, gradient_sync: Any = None,
                 storage: VariableStorage = MIRRORED, on_finish: Callable[[list], None] | None = None):
        self._strategy = strategy
        self._devices = tuple(devices)
        self._gradient_sync = gradient_sync
        self._storage = storage
        self._on_finish = on_finish
        self._single = (
            PlainVariablePolicy(self._devices[0], gradient_sync, on_finish) if len(self._devices) == 1 else None
        )

    def wrap_parameter(self, param: nn.Parameter, name: str) -> nn.Parameter | None:
        if self._single is not None:
            return self._single.wrap_parameter(param, name)
        if isinstance(param, DistributedVariable) and param.distribute_strategy is self._strategy:
            return None  # registered again (a tied weight, `b.weight = a.weight`): one variable, not a copy
        variable = MirroredVariable(param.detach().to(torch_device(self._devices[0])), self._strategy, self._devices,
                                    VariableAggregation.NONE, name, requires_grad=param.requires_grad,
                                    storage=self._storage)
        if self._gradient_sync is not None:
            attach(variable, self._gradient_sync)
            self._gradient_sync.register(variable)
        return variable

    def wrap_buffer(self, buffer: torch.Tensor, name: str) -> torch.Tensor | None:
        """Several replicas: each gets its own copy of a buffer; a cross-replica read averages.

        Floating buffers (running statistics) read back as the replicas' mean, others
        (counters) as replica 0's value.
        """
        if self._single is not None:
            return self._single.wrap_buffer(buffer, name)
        aggregation = (VariableAggregation.MEAN if buffer.is_floating_point()
                       else VariableAggregation.ONLY_FIRST_REPLICA)
        return SyncOnReadVariable(buffer.detach().to(torch_device(self._devices[0])), self._strategy,
                                  self._devices, aggregation, name)

    def create(self, value: torch.Tensor, *, trainable: bool, name: str | None,
               synchronization: VariableSynchronization, aggregation: VariableAggregation) -> torch.Tensor:
        data = value.detach().to(torch_device(self._devices[0]))
        if synchronization is VariableSynchronization.ON_READ:
            return typing.cast(torch.Tensor, SyncOnReadVariable(data, self._strategy, self._devices, aggregation, name))
        variable = MirroredVariable(data, self._strategy, self._devices, aggregation, name,
                                    requires_grad=trainable and data.is_floating_point(), storage=self._storage)
        if self._gradient_sync is not None and variable.requires_grad:
            self._gradient_sync.register(variable)
        return variable

    def finish(self, variables: list) -> None:
        if self._on_finish is not None:
            self._on_finish(variables)  # across workers first: the chief's component 0 wins
        for variable in variables:
            if isinstance(variable, DistributedVariable):
                variable._broadcast_primary()

    def placement(self, variable: Any) -> str | list[str]:
        """The devices of a distributed variable's components (the device of a plain one)."""
        if isinstance(variable, DistributedVariable):
            return list(variable.devices)
        if self._single is not None:
            return self._single.placement(variable)
        raise ValueError(f"{type(variable).__name__} was not created in this strategy's scope; "
                         f"it has no placement here")
