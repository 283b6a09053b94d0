"""The replica context (``tf.distribute.ReplicaContext``).

Each replica of ``strategy.run`` runs in its own :class:`ReplicaContext`;
``strategy.scope()`` is *cross-replica* context. The functions that find the current
context (``get_strategy``, ``get_replica_context``, ...) live in
``unison._strategies.current``, above the strategies, because outside any scope they
answer with the default strategy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch.utils import _pytree as pytree

from unison._reduce import ReduceOp
from unison._values.values import is_distributed

if TYPE_CHECKING:  # pragma: no cover
    from unison._strategies.base import Strategy

__all__ = ["ReplicaContext"]

MergeFn = Callable[..., Any]


class ReplicaContext:
    """The context of one replica inside ``strategy.run`` (``tf.distribute.ReplicaContext``).

    Gives the replica's id and the collective operations that replicas call together:
    ``merge_call``, ``all_reduce`` and ``all_gather``. Every replica must make the same
    sequence of these calls.
    """

    def __init__(self, strategy: Strategy, local_replica_id: int, replica_id_in_sync_group: int,
                 merge: Callable[..., Any]):
        self._strategy = strategy
        self._local_replica_id = local_replica_id
        self._replica_id_in_sync_group = replica_id_in_sync_group
        self._merge = merge

    @property
    def strategy(self) -> Strategy:
        """The strategy that runs this replica."""
        return self._strategy

    @property
    def num_replicas_in_sync(self) -> int:
        """Replicas of all workers that take part in each step."""
        return self._strategy.num_replicas_in_sync

    @property
    def replica_id_in_sync_group(self) -> int:
        """This replica's id among all replicas of all workers, 0-based."""
        return self._replica_id_in_sync_group

    @property
    def local_replica_id(self) -> int:
        """This replica's index among this worker's replicas: which component of a
        distributed variable it reads (a unison extension; TF keeps it private)."""
        return self._local_replica_id

    @property
    def devices(self) -> tuple[str, ...]:
        """The device(s) this replica runs on (``tf.distribute.ReplicaContext.devices``)."""
        return (self._strategy.extended.worker_devices[self._local_replica_id],)

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

    def all_reduce(self, reduce_op: ReduceOp | str, value: Any) -> Any:
        """All-reduces ``value`` (a tensor or a nested structure of tensors) across replicas."""
        reduce_op = ReduceOp.from_any(reduce_op)

        def merge_fn(strategy: Strategy, per_replica: Any) -> Any:
            leaves, spec = pytree.tree_flatten(per_replica, is_leaf=is_distributed)
            pairs = [(leaf, leaf) for leaf in leaves]
            reduced = strategy.extended.batch_reduce_to(reduce_op, pairs) if pairs else []
            return pytree.tree_unflatten(list(reduced), spec)

        return self.merge_call(merge_fn, args=(value,))

    def all_gather(self, value: Any, axis: int) -> Any:
        """Concatenates every replica's ``value`` along ``axis``; each replica gets the whole."""

        def merge_fn(strategy: Strategy, per_replica: Any) -> Any:
            def gather(leaf: Any) -> Any:
                return strategy.extended.gather_to(leaf, axis=axis, destinations=leaf)

            return pytree.tree_map(gather, per_replica, is_leaf=is_distributed)

        return self.merge_call(merge_fn, args=(value,))

    def __repr__(self) -> str:
        return (
            f"ReplicaContext(replica_id_in_sync_group={self.replica_id_in_sync_group}, "
            f"num_replicas_in_sync={self.num_replicas_in_sync})"
        )
