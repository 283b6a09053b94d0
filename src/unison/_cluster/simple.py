"""An explicit cluster resolver: the caller states the cluster and the task."""

from __future__ import annotations

from collections.abc import Mapping

from unison._cluster import multi_worker_util
from unison._cluster.base import ClusterResolver, format_master_url
from unison._cluster.known_schedulers import scheduler_named
from unison._cluster.scheduler import Scheduler
from unison._cluster.spec import ClusterLike, ClusterSpec

__all__ = ["SimpleClusterResolver"]


class SimpleClusterResolver(ClusterResolver):
    """Resolver holding a given cluster, task, accelerator count and RPC layer.

    Used by tests, by programs that compute their cluster themselves, and by strategies
    re-configured for a task (``strategy.configure``). An empty cluster is local
    training, which is what ``cluster.detect`` returns when no environment is found.

    tf.distribute equivalent: ``tf.distribute.cluster_resolver.SimpleClusterResolver``.

    Args:
        cluster_spec: the cluster (a ClusterSpec or a dict).
        master: returned by ``master()`` when no task is named (prefixed with the RPC
            layer unless it already is a URL).
        task_type: this task's type.
        task_id: this task's index.
        environment: the environment's name; "torchrun" or "slurm" bring that scheduler's
            conventions (local rank, rendezvous, CPU share, restart advice), as when
            ``MultiWorkerMirroredStrategy.configure`` re-targets a strategy detected there.
        num_accelerators: accelerators per task, e.g. ``{"GPU": 2}`` (default ``{"GPU": 0}``).
        rpc_layer: protocol for master URLs.

    Raises:
        ValueError: if the cluster or the task breaks the cluster rules.
    """

    def __init__(
        self,
        cluster_spec: ClusterLike | None = None,
        master: str = "",
        task_type: str | None = None,
        task_id: int | None = None,
        environment: str = "",
        num_accelerators: Mapping[str, int] | None = None,
        rpc_layer: str | None = None,
    ):
        self._cluster_spec = multi_worker_util.normalize_cluster_spec(cluster_spec)
        self._sparse_jobs = {
            job: {int(index): address for index, address in tasks.items()}
            for job, tasks in (cluster_spec.items() if isinstance(cluster_spec, Mapping) else ())
            if isinstance(tasks, Mapping)
        }
        if task_type is not None or self._cluster_spec:
            multi_worker_util.validate_cluster_spec(self._cluster_spec, task_type, task_id)
        self._master = master
        self._task_type = task_type
        self._task_id = task_id
        self._environment = environment
        self._num_accelerators = dict(num_accelerators) if num_accelerators else {"GPU": 0}
        self._rpc_layer = rpc_layer

    def cluster_spec(self) -> ClusterSpec:
        return self._cluster_spec

    @property
    def sparse_jobs(self) -> dict[str, dict[int, str]]:
        """The jobs given as task index -> address dicts (TF's sparse jobs), which
        ``UnionResolver`` merges by index instead of concatenating."""
        return {job: dict(tasks) for job, tasks in self._sparse_jobs.items()}

    @property
    def task_type(self) -> str | None:
        return self._task_type

    @task_type.setter
    def task_type(self, task_type: str | None) -> None:
        self._task_type = task_type

    @property
    def task_id(self) -> int | None:
        return self._task_id

    @task_id.setter
    def task_id(self, task_id: int | None) -> None:
        self._task_id = task_id

    @property
    def rpc_layer(self) -> str | None:
        return self._rpc_layer

    @rpc_layer.setter
    def rpc_layer(self, rpc_layer: str | None) -> None:
        self._rpc_layer = rpc_layer

    @property
    def environment(self) -> str:
        return self._environment

    @property
    def scheduler(self) -> Scheduler:
        return scheduler_named(self._environment)

    def num_accelerators(self, task_type: str | None = None, task_id: int | None = None) -> dict[str, int]:
        return dict(self._num_accelerators)

    def master(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        rpc_layer: str | None = None,
    ) -> str:
        if task_type is not None and task_id is not None:
            address = self._cluster_spec.task_address(task_type, task_id)
            return format_master_url(address, rpc_layer or self._rpc_layer)
        if not self._master or "://" in self._master:
            return self._master  # already a URL: keep its protocol
        return format_master_url(self._master, rpc_layer or self._rpc_layer)
