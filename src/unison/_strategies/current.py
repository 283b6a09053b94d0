"""Which strategy and context are current (``tf.distribute.get_strategy`` & co).

Outside any ``scope()`` the default strategy is current and code runs in the default
replica context (one replica). ``strategy.scope()`` enters *cross-replica* context;
each replica of ``strategy.run`` runs in its own ReplicaContext. These functions sit
above the strategies (not in ``unison._context``) because their answer outside any
scope is the default strategy.
"""

from __future__ import annotations

from typing import Any

from unison._context import ReplicaContext
from unison._state import STATE
from unison._strategies.base import Strategy
from unison._strategies.default import default_replica_context, default_strategy
from unison.errors import UsageError

__all__ = [
    "get_strategy",
    "has_strategy",
    "get_replica_context",
    "in_cross_replica_context",
    "get_cross_replica_context",
    "experimental_set_strategy",
]


def get_strategy() -> Strategy:
    """The current strategy: the innermost ``scope()`` or ``run`` of this thread, else the default."""
    entry = STATE.top()
    return entry.strategy if entry is not None else default_strategy()


def has_strategy() -> bool:
    """Whether a non-default strategy is current in this thread."""
    entry = STATE.top()
    return entry is not None and not entry.strategy.extended.components.is_default


def get_replica_context() -> ReplicaContext | None:
    """This replica's context; None in cross-replica context (inside ``scope()``, outside ``run``)."""
    entry = STATE.top()
    return entry.replica_context if entry is not None else default_replica_context()


def in_cross_replica_context() -> bool:
    """True inside ``strategy.scope()`` but outside ``strategy.run`` (and inside merge functions)."""
    entry = STATE.top()
    return entry is not None and entry.replica_context is None


def get_cross_replica_context() -> Strategy | None:
    """The current strategy in cross-replica context, else None."""
    entry = STATE.top()
    if entry is None:
        return None
    return entry.strategy if entry.replica_context is None else None


def experimental_set_strategy(strategy: Strategy | None) -> None:
    """Makes ``strategy`` current in this thread without a ``with`` block; None undoes it.

    Like entering ``strategy.scope()`` and never leaving it, until the next call. As in
    TensorFlow (``tf.distribute.experimental_set_strategy``) it must not be called inside a
    strategy's scope (other than one it set itself).

    Raises:
        RuntimeError: if called inside a ``strategy.scope()``.
        TypeError: if ``strategy`` is neither a Strategy nor None.
    """
    if strategy is not None and not isinstance(strategy, Strategy):
        raise TypeError(f"experimental_set_strategy takes a unison Strategy or None, got {type(strategy).__name__}")
    previous = STATE.set_strategy_scope
    entry = STATE.top()
    inside_other = entry is not None and (previous is None or previous.strategy is not entry.strategy
                                          or entry.replica_context is not None or previous.depth != STATE.depth())
    if inside_other:
        raise UsageError(
            "experimental_set_strategy must not be called inside a strategy's scope (or strategy.run); "
            "leave the `with strategy.scope():` block first"
        )
    if previous is not None:
        STATE.set_strategy_scope = None
        previous.context.__exit__(None, None, None)
    if strategy is not None:
        context = strategy.scope()
        context.__enter__()
        STATE.set_strategy_scope = _SetScope(strategy, context, STATE.depth())


class _SetScope:
    """A scope entered by ``experimental_set_strategy``: the strategy, its open context, the stack depth."""

    __slots__ = ("strategy", "context", "depth")

    def __init__(self, strategy: Strategy, context: Any, depth: int):
        self.strategy, self.context, self.depth = strategy, context, depth
