"""The default strategy: what is current outside any ``scope()`` (one replica, no distribution)."""

from __future__ import annotations

import functools

from unison.collectives.local import ReductionToOneDevice
from unison.context import ReplicaContext
from unison.strategies.base import Components, Strategy
from unison.strategies.policies import PlainVariablePolicy

__all__ = ["default_strategy", "default_replica_context"]


class _DefaultStrategy(Strategy):
    """One replica on the host; variables are plain tensors."""

    def __reduce__(self) -> tuple:
        return default_strategy, ()

    def __init__(self) -> None:
        super().__init__(Components(
            devices=("cpu:0",), parameter_devices=("cpu:0",), cross_device_ops=ReductionToOneDevice(),
            variable_policy=PlainVariablePolicy("cpu:0"), gradient_sync=None, is_default=True,
        ))


@functools.lru_cache(maxsize=None)
def default_strategy() -> Strategy:
    """The process's default strategy (one instance)."""
    return _DefaultStrategy()


@functools.lru_cache(maxsize=None)
def default_replica_context() -> ReplicaContext:
    """The replica context of code running outside any strategy."""
    strategy = default_strategy()
    return strategy.extended._c.runner._context
