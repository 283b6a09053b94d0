"""PlacementConfig: the three facts about the cluster that ensemble placement needs.

A placement strategy decides what this worker builds from how many workers train, which
one this is, and how many parameter servers hold the variables. Those facts come from
the cluster (chief + workers count as workers, the chief being worker 0; ps and
evaluator tasks are not workers), counted by the same rules as
``unison._cluster.multi_worker_util``, so placement agrees with the strategies.

AdaNet equivalent: the ``tf.estimator.RunConfig`` given to a placement strategy, of which
it reads ``num_worker_replicas``, ``global_id_in_cluster`` and ``num_ps_replicas``.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from unison._cluster import multi_worker_util
from unison._cluster.base import ClusterResolver
from unison._cluster.spec import ClusterLike

__all__ = ["PlacementConfig"]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class PlacementConfig:
    """Where this process sits in the cluster, as ensemble placement sees it.

    Build it by hand for tests and tools, or from the running cluster with
    :meth:`from_strategy` / :meth:`from_cluster_resolver` /
    :meth:`from_cluster_spec`.

    AdaNet equivalent: the ``RunConfig`` assigned to ``PlacementStrategy.config``
    (only the three fields below are read).

    Args:
        num_worker_replicas: workers that train, the chief included (>= 1).
        global_id_in_cluster: this worker's index among them (the chief is 0), or None,
            which counts as worker 0 (a client, or local training).
        num_ps_replicas: parameter-server tasks (>= 0).

    Raises:
        ValueError: for a non-integer or non-positive worker count, a negative ps count,
            or an index outside ``0..num_worker_replicas - 1``.

    Example:
        >>> PlacementConfig(num_worker_replicas=4, global_id_in_cluster=2, num_ps_replicas=2).worker_index
        2
    """

    num_worker_replicas: int = 1
    global_id_in_cluster: int | None = None
    num_ps_replicas: int = 0

    def __post_init__(self) -> None:
        workers = self.num_worker_replicas
        if not _is_int(workers) or workers < 1:
            raise ValueError(
                f"PlacementConfig.num_worker_replicas must be an integer >= 1 (the chief and workers that "
                f"train), got {workers!r}; fix `num_worker_replicas`, e.g. 1 for local training"
            )
        ps = self.num_ps_replicas
        if not _is_int(ps) or ps < 0:
            raise ValueError(
                f"PlacementConfig.num_ps_replicas must be an integer >= 0, got {ps!r}; "
                f"fix `num_ps_replicas`, e.g. 0 when there are no parameter servers"
            )
        index = self.global_id_in_cluster
        if index is not None and (not _is_int(index) or not 0 <= index < workers):
            raise ValueError(
                f"PlacementConfig.global_id_in_cluster {index!r} is out of range: the cluster has {workers} "
                f"worker(s) (valid 0..{workers - 1}, or None for worker 0); fix `global_id_in_cluster`"
            )

    @property
    def worker_index(self) -> int:
        """``global_id_in_cluster``, with None read as worker 0 (as AdaNet reads it)."""
        return self.global_id_in_cluster or 0

    @classmethod
    def from_cluster_spec(
        cls, cluster_spec: ClusterLike | None, task_type: str | None = None, task_id: int | None = None
    ) -> PlacementConfig:
        """The config of task ``(task_type, task_id)`` of ``cluster_spec``.

        Workers are the chief and the workers (``multi_worker_util.worker_count``); the
        index is ``multi_worker_util.id_in_cluster`` (chief 0, then workers in order); ps
        tasks are counted by ``multi_worker_util.task_count``. An empty cluster is local
        training: one worker, index 0, no ps. No task type (a client) gives index None.
        The evaluator is alone in a cluster of its own, as in ``multi_worker_util``: one
        worker, index 0, no ps (it evaluates checkpoints, it does not read the ps).

        Raises:
            ValueError: for an invalid cluster or task (see
                ``multi_worker_util.validate_cluster_spec``), a cluster without chief or
                worker, or a ps task (it builds no part of the ensemble).
        """
        spec = multi_worker_util.validate_cluster_spec(cluster_spec, task_type, task_id)
        if not spec:
            return cls(num_worker_replicas=1, global_id_in_cluster=0, num_ps_replicas=0)
        if task_type == "evaluator":
            return cls(num_worker_replicas=1, global_id_in_cluster=0, num_ps_replicas=0)
        if task_type == "ps":
            raise ValueError(
                f"task ('ps', {task_id!r}) has no ensemble placement: parameter servers hold variables and "
                f"build nothing; build a PlacementConfig only on 'chief' and 'worker' tasks (fix `task_type`)"
            )
        workers = multi_worker_util.task_count(spec, "chief") + multi_worker_util.task_count(spec, "worker")
        if workers == 0:
            raise ValueError(
                f"cluster {spec.as_dict()!r} has no 'chief' or 'worker' task, so no worker can build the "
                f"ensemble; add `cluster.worker` (or `cluster.chief`)"
            )
        num_ps = multi_worker_util.task_count(spec, "ps")
        if task_type is None:
            return cls(num_worker_replicas=workers, global_id_in_cluster=None, num_ps_replicas=num_ps)
        task_index = typing.cast(int, task_id)  # validate_cluster_spec checked it is an integer
        return cls(
            num_worker_replicas=multi_worker_util.worker_count(spec, task_type),
            global_id_in_cluster=multi_worker_util.id_in_cluster(spec, task_type, task_index),
            num_ps_replicas=num_ps,
        )

    @classmethod
    def from_cluster_resolver(cls, resolver: ClusterResolver) -> PlacementConfig:
        """The config of the resolver's own task (see :meth:`from_cluster_spec`).

        Raises:
            TypeError: if ``resolver`` is not a ``unison.ClusterResolver``.
            ValueError: as :meth:`from_cluster_spec`.
        """
        if not isinstance(resolver, ClusterResolver):
            raise TypeError(
                f"PlacementConfig.from_cluster_resolver needs a unison.ClusterResolver, got "
                f"{type(resolver).__name__}; pass e.g. unison.TFConfigClusterResolver(), or use "
                f"PlacementConfig.from_cluster_spec(spec, task_type, task_id)"
            )
        return cls.from_cluster_spec(resolver.cluster_spec(), resolver.task_type, resolver.task_id)

    @classmethod
    def from_strategy(cls, strategy: Any) -> PlacementConfig:
        """The config of the cluster ``strategy`` trains on.

        Inside a distribute-coordinator ``worker_fn`` the coordinator's worker context is
        the cluster (the coordinator ``configure()``-s the strategy with it, and it may
        differ from what the strategy's resolver saw at construction). Otherwise a
        strategy with a ``cluster_resolver`` (MultiWorkerMirroredStrategy, the
        parameter-server strategy) answers through :meth:`from_cluster_resolver`; a local
        strategy (OneDevice, Mirrored, CentralStorage, the default) is one worker, index
        0, no ps.

        Raises:
            TypeError: if ``strategy`` is not a ``unison.Strategy``.
            ValueError: as :meth:`from_cluster_spec`.
        """
        from unison._coordinator.worker_context import get_current_worker_context
        from unison._strategies.base import Strategy

        if not isinstance(strategy, Strategy):
            raise TypeError(
                f"PlacementConfig.from_strategy needs a unison.Strategy, got {type(strategy).__name__}; "
                f"pass the strategy you train with, e.g. unison.MultiWorkerMirroredStrategy()"
            )
        context = get_current_worker_context()
        if context is not None and context.cluster_spec:
            return cls.from_cluster_spec(context.cluster_spec, context.task_type, context.task_id)
        resolver = getattr(strategy, "cluster_resolver", None)
        if resolver is not None:
            return cls.from_cluster_resolver(resolver)
        return cls(num_worker_replicas=1, global_id_in_cluster=0, num_ps_replicas=0)
