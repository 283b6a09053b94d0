"""The default strategy: what is current outside any ``scope()`` (one replica, no distribution)."""

from __future__ import annotations

import functools
import typing

from unison._collectives.ops.local import ReductionToOneDevice
from unison._context import ReplicaContext
from unison._embeddings.tables.table import LocalTables
from unison._strategies.base import Strategy
from unison._strategies.components import StrategyComponents
from unison._strategies.policies import PlainVariablePolicy
from unison._strategies.replicas import InlineReplicaRunner

__all__ = ["default_strategy", "default_replica_context"]


@typing.final
class _DefaultStrategy(Strategy):
    """One replica on the host; variables are plain tensors."""

    def __reduce__(self) -> tuple:
        return default_strategy, ()

    def __init__(self) -> None:
        self._runner = InlineReplicaRunner(self, ("cpu:0",))
        super().__init__(StrategyComponents(
            devices=("cpu:0",), parameter_devices=("cpu:0",), cross_device_ops=ReductionToOneDevice(),
            variable_policy=PlainVariablePolicy("cpu:0"), runner=self._runner, is_default=True, tables=LocalTables(),
        ))

    @property
    def cluster_resolver(self) -> None:
        """None: the default strategy runs in this process only."""
        return None

    @property
    def replica_context(self) -> ReplicaContext:
        """The replica context of code running outside any strategy."""
        return self._runner.context


@functools.cache
def _the_default() -> _DefaultStrategy:
    return _DefaultStrategy()


def default_strategy() -> Strategy:
    """The process's default strategy (one instance)."""
    return _the_default()


def default_replica_context() -> ReplicaContext:
    """The replica context of code running outside any strategy."""
    return _the_default().replica_context
