"""OneDeviceStrategy: everything on one device (``tf.distribute.OneDeviceStrategy``)."""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import Any

import torch

from unison._collectives.ops.local import ReductionToOneDevice
from unison._devices import canonicalize
from unison._embeddings.tables.table import LocalTables
from unison._interpose.torch_private import torch_function_modes
from unison._state import STATE, ContextEntry
from unison._strategies.base import Strategy
from unison._strategies.components import StrategyComponents
from unison._strategies.policies import PlainVariablePolicy
from unison._strategies.replicas import PLAIN_TENSOR, InlineReplicaRunner

__all__ = ["OneDeviceStrategy"]


@typing.final
class OneDeviceStrategy(Strategy):
    """Places variables and computation on a single device.

    Useful to write code once and switch to a distributing strategy later. Module
    parameters built in ``scope()`` move to the device; ``run`` calls the function
    inline, with no thread and no hook, so a step costs what plain PyTorch costs.

    Example:
        >>> strategy = OneDeviceStrategy("cpu:0")
        >>> strategy.run(lambda: torch.ones(2)).sum().item()
        2.0
    """

    def __init__(self, device: str | torch.device):
        self._init_args = (device,)
        name = canonicalize(device)
        self._runner = InlineReplicaRunner(self, (name,))
        self._entry: ContextEntry | None = None  # the replica's context entry, once the strategy is complete
        super().__init__(StrategyComponents(
            devices=(name,), parameter_devices=(name,), cross_device_ops=ReductionToOneDevice(),
            variable_policy=PlainVariablePolicy(name), runner=self._runner, tables=LocalTables(),
        ))

    def run(self, fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None) -> Any:
        """Runs ``fn(*args, **kwargs)`` in the one replica's context and returns its result.

        PerReplica arguments are unwrapped to the replica's component.
        """
        # The usual step (plain tensor arguments, outside any scope, nothing to finish) takes
        # one frame between the caller and fn: the general path's three cost D's 112 us step
        # 6.2 us above plain PyTorch, this one 3.6 (own processes). The stack is read as an
        # attribute: in one process, 2.4 us over calling fn directly, against 3.3-3.6 through a
        # method (benchmarks/RESULTS.md, 'OneDevice D', "OneDevice's step path in cache terms").
        stack = STATE.per_thread.stack
        if (stack or kwargs or not PLAIN_TENSOR.issuperset(map(type, args)) or self._extended._pending
                or torch_function_modes()):
            return super().run(fn, args, kwargs)
        entry = self._entry
        if entry is None:
            entry = self._entry = self._runner.entry
        stack.append(entry)
        try:
            return fn(*args)
        finally:
            stack.pop()

    @property
    def cluster_resolver(self) -> None:
        """None: one device of this process."""
        return None
