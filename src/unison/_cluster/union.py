"""UnionResolver: one cluster from several resolvers, by TensorFlow's merge rules.

Used to combine clusters described in different places (workers from one scheduler, ps
tasks from a list) or to override one answer of a resolver (its accelerator count) by
putting a SimpleClusterResolver first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from unison._cluster.base import ClusterResolver, format_master_url
from unison._cluster.scheduler import Scheduler
from unison._cluster.simple import SimpleClusterResolver
from unison._cluster.spec import ClusterSpec

__all__ = ["UnionResolver", "merge_clusters"]


def merge_clusters(clusters: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Merges job -> tasks mappings by TensorFlow's ``UnionResolver`` rules.

    A job given as a list everywhere gets the concatenation of the lists, in order. A
    job given as a dict (task index -> address) anywhere is merged as dicts, a list
    counting as indices 0..N-1; an index given twice raises KeyError.

    Example:
        >>> merge_clusters([{"worker": ["a:1"]}, {"worker": ["b:1"], "ps": ["c:1"]}])
        {'worker': ['a:1', 'b:1'], 'ps': ['c:1']}

    Raises:
        KeyError: if two clusters give the same task index of a job merged as dicts.
    """
    sparse = {job for cluster in clusters for job, tasks in cluster.items() if isinstance(tasks, Mapping)}
    merged: dict[str, Any] = {}
    for cluster in clusters:
        for job, tasks in cluster.items():
            if job not in sparse:
                merged.setdefault(job, []).extend(tasks)
                continue
            given = {int(k): v for k, v in tasks.items()} if isinstance(tasks, Mapping) else dict(enumerate(tasks))
            into = merged.setdefault(job, {})
            clash = sorted(set(given) & set(into))
            if clash:
                raise KeyError(f"job {job!r} has task index(es) {clash!r} in two of the merged clusters; "
                               f"give each index once, or give the job as lists to concatenate them")
            into.update(given)
    return merged


def _given_form(resolver: ClusterResolver) -> dict[str, Any]:
    # unison's ClusterSpec is dense, so only a SimpleClusterResolver remembers which jobs
    # its caller gave as index -> address dicts (TF's sparse jobs); other resolvers list.
    spec: dict[str, Any] = dict(resolver.cluster_spec().as_dict())
    if isinstance(resolver, SimpleClusterResolver):
        spec.update(resolver.sparse_jobs)
    return spec


class UnionResolver(ClusterResolver):
    """The union of several resolvers' clusters; the first answers everything else.

    ``cluster_spec()`` merges every resolver's cluster (:func:`merge_clusters`); task
    type and id, environment, scheduler and accelerators come from the first resolver, unless
    overridden here; ``rpc_layer`` is the override, else the first resolver's.

    tf.distribute equivalent: ``tf.distribute.cluster_resolver.UnionResolver``.
    Difference: an override of ``task_id=0`` counts (TF's ``or`` dropped it), and a job
    is "sparse" only where a SimpleClusterResolver was given it as a dict.

    Example:
        >>> workers = SimpleClusterResolver({"worker": ["w0:2222", "w1:2222"]}, task_type="worker", task_id=0)
        >>> ps = SimpleClusterResolver({"ps": ["p0:2222"]}, task_type="ps", task_id=0)
        >>> union = UnionResolver(workers, ps, rpc_layer="grpc")
        >>> union.cluster_spec().as_dict(), union.task_type, union.master()
        ({'ps': ['p0:2222'], 'worker': ['w0:2222', 'w1:2222']}, 'worker', '')

    Args:
        *resolvers: the resolvers to merge, at least one.
        rpc_layer: overrides the first resolver's RPC layer.
        task_type: overrides the first resolver's task type.
        task_id: overrides the first resolver's task index.

    Raises:
        ValueError: if no resolver is given.
        TypeError: if an argument is not a ClusterResolver.
    """

    def __init__(self, *resolvers: ClusterResolver, rpc_layer: str | None = None,
                 task_type: str | None = None, task_id: int | None = None):
        if not resolvers:
            raise ValueError("UnionResolver needs at least one ClusterResolver; pass the resolvers to merge")
        for i, resolver in enumerate(resolvers):
            if not isinstance(resolver, ClusterResolver):
                raise TypeError(f"UnionResolver argument {i} is a {type(resolver).__name__} ({resolver!r}), not a "
                                f"ClusterResolver; pass resolvers such as SimpleClusterResolver")
        self._resolvers = resolvers
        self._rpc_layer = rpc_layer
        self._task_type = task_type
        self._task_id = task_id

    def cluster_spec(self) -> ClusterSpec:
        """The merged cluster.

        Raises:
            KeyError: if a task index of a sparse job is given twice.
            ValueError: if the merged cluster is invalid (a gap in indices, an address twice).
        """
        return ClusterSpec(merge_clusters([_given_form(r) for r in self._resolvers]))

    @property
    def task_type(self) -> str | None:
        return self._task_type if self._task_type is not None else self._resolvers[0].task_type

    @task_type.setter
    def task_type(self, task_type: str | None) -> None:
        self._task_type = task_type

    @property
    def task_id(self) -> int | None:
        return self._task_id if self._task_id is not None else self._resolvers[0].task_id

    @task_id.setter
    def task_id(self, task_id: int | None) -> None:
        self._task_id = task_id

    @property
    def rpc_layer(self) -> str | None:
        return self._rpc_layer if self._rpc_layer is not None else self._resolvers[0].rpc_layer

    @rpc_layer.setter
    def rpc_layer(self, rpc_layer: str | None) -> None:
        self._rpc_layer = rpc_layer

    @property
    def environment(self) -> str:
        return self._resolvers[0].environment

    @property
    def scheduler(self) -> Scheduler:
        return self._resolvers[0].scheduler

    def num_accelerators(self, task_type: str | None = None, task_id: int | None = None) -> dict[str, int]:
        return self._resolvers[0].num_accelerators(task_type, task_id)

    def master(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        rpc_layer: str | None = None,
    ) -> str:
        """A named task's URL in the merged cluster; without one, the first resolver's master."""
        if task_type is not None and task_id is not None:
            return format_master_url(self.cluster_spec().task_address(task_type, task_id), rpc_layer or self.rpc_layer)
        return self._resolvers[0].master(rpc_layer=rpc_layer)
