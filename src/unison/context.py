"""Replica and cross-replica contexts (``tf.distribute.get_replica_context`` & co).

Outside any ``scope()`` the default strategy is current and the code runs in the
default replica context (one replica). ``strategy.scope()`` enters *cross-replica*
context; each replica of ``strategy.run`` runs in its own :class:`ReplicaContext`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from torch.utils import _pytree as pytree

from unison._state import STATE
from unison.reduce import ReduceOp
from unison.values.values import is_distributed

if TYPE_CHECKING:  # pragma: no cover
    from unison.strategies.base import Strategy

__all__ = [
    "ReplicaContext",
    "get_strategy",
    "has_strategy",
    "get_replica_context",
    "in_cross_replica_context",
    "get_cross_replica_context",
]

MergeFn = Callable[..., Any]


class ReplicaContext:
    """The context of one replica inside ``strategy.run`` (``tf.distribute.ReplicaContext``).

    Gives the replica's id and the collective operations that replicas call together:
    ``merge_call``, ``all_reduce`` and ``all_gather``. Every replica must make the same
    sequence of these calls.
    """

    def __init__(self, strategy: "Strategy", local_replica_id: int, merge: Callable[..., Any]):
        self._strategy = strategy
        self._local_replica_id = local_replica_id
        self._merge = merge
        self._local_writes = 0  # > 0 while an optimizer step writes this replica's own components
        self._no_sync = 0  # > 0 inside strategy.extended.no_sync(): backward passes do not reduce
        self._backward_sync_queued = False  # an end-of-backward reduction is queued
        self._grads_reduced = False  # a backward pass reduced the gradients since the last step

    @property
    def strategy(self) -> "Strategy":
        """The strategy that runs this replica."""
        return self._strategy

    @property
    def num_replicas_in_sync(self) -> int:
        """Replicas of all workers that take part in each step."""
        return self._strategy.num_replicas_in_sync

    @property
    def replica_id_in_sync_group(self) -> int:
        """This replica's id among all replicas of all workers, 0-based."""
        return self._strategy.extended._global_replica_id(self._local_replica_id)

    def merge_call(self, merge_fn: MergeFn, args: tuple = (), kwargs: dict | None = None) -> Any:
        """Runs ``merge_fn(strategy, *args, **kwargs)`` once, in cross-replica context.

        Every replica must call ``merge_call``; when all have, their ``args`` are
        regrouped (values that differ become PerReplica) and ``merge_fn`` runs once.
        Each replica gets the result, with PerReplica/Mirrored parts replaced by its own
        component.

        Raises:
            MergeCallError: if some replicas returned without calling merge_call while
                others waited in it.
        """
        return self._merge(self._local_replica_id, merge_fn, tuple(args), dict(kwargs or {}))

    def all_reduce(self, reduce_op: "ReduceOp | str", value: Any) -> Any:
        """All-reduces ``value`` (a tensor or a nested structure of tensors) across replicas."""
        reduce_op = ReduceOp.from_any(reduce_op)

        def merge_fn(strategy: "Strategy", per_replica: Any) -> Any:
            leaves, spec = pytree.tree_flatten(per_replica, is_leaf=is_distributed)
            pairs = [(leaf, leaf) for leaf in leaves]
            reduced = strategy.extended.batch_reduce_to(reduce_op, pairs) if pairs else []
            return pytree.tree_unflatten(list(reduced), spec)

        return self.merge_call(merge_fn, args=(value,))

    def all_gather(self, value: Any, axis: int) -> Any:
        """Concatenates every replica's ``value`` along ``axis``; each replica gets the whole."""

        def merge_fn(strategy: "Strategy", per_replica: Any) -> Any:
            def gather(leaf: Any) -> Any:
                return strategy.extended._gather_to(leaf, axis=axis, destinations=leaf)

            return pytree.tree_map(gather, per_replica, is_leaf=is_distributed)

        return self.merge_call(merge_fn, args=(value,))

    def __repr__(self) -> str:
        return (
            f"ReplicaContext(replica_id_in_sync_group={self.replica_id_in_sync_group}, "
            f"num_replicas_in_sync={self.num_replicas_in_sync})"
        )


def get_strategy() -> "Strategy":
    """The current strategy: the innermost ``scope()`` or ``run`` of this thread, else the default."""
    entry = STATE.top()
    if entry is not None:
        return entry.strategy
    from unison.strategies.default import default_strategy

    return default_strategy()


def has_strategy() -> bool:
    """Whether a non-default strategy is current in this thread."""
    entry = STATE.top()
    return entry is not None and not entry.strategy.extended._is_default


def get_replica_context() -> ReplicaContext | None:
    """This replica's context; None in cross-replica context (inside ``scope()``, outside ``run``)."""
    entry = STATE.top()
    if entry is not None:
        return entry.replica_context
    from unison.strategies.default import default_replica_context

    return default_replica_context()


def in_cross_replica_context() -> bool:
    """True inside ``strategy.scope()`` but outside ``strategy.run`` (and inside merge functions)."""
    entry = STATE.top()
    return entry is not None and entry.replica_context is None


def get_cross_replica_context() -> "Strategy | None":
    """The current strategy in cross-replica context, else None."""
    entry = STATE.top()
    if entry is None:
        return None
    return entry.strategy if entry.replica_context is None else None
