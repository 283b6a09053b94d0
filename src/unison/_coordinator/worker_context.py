"""The worker context: what a ``worker_fn`` can ask about its task while it runs.

The coordinator calls ``worker_fn(strategy)`` inside a WorkerContext; code anywhere
below it reaches the context through ``get_current_worker_context()`` to learn its
task, whether it is chief, and to wait for the other workers.

tf.distribute equivalent: ``distribute_coordinator._WorkerContext`` and
``distribute_coordinator_context.get_current_worker_context``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, Protocol

from unison._cluster import multi_worker_util
from unison._cluster.base import format_master_url
from unison._cluster.spec import ClusterSpec
from unison._state import STATE

__all__ = ["WorkerContext", "Barrier", "get_current_worker_context", "run_in_worker_context"]


class Barrier(Protocol):
    """Anything whose ``wait()`` returns once every worker has called it."""

    def wait(self) -> None: ...


def get_current_worker_context() -> WorkerContext | None:
    """The WorkerContext of the ``worker_fn`` running in this thread, or None."""
    return STATE.worker_context


class WorkerContext:
    """Configuration of one task while its ``worker_fn`` runs.

    Args:
        strategy: the task's configured strategy, or None (an evaluator without one).
        cluster_spec: the cluster; empty or None for local training.
        task_type: the task's type; None in local training or for in-graph replication.
        task_id: the task's index; None as for ``task_type``.
        rpc_layer: protocol of ``master_target`` (default ``"tcp"``).
        barrier: what ``wait_for_other_workers`` waits on; None where there is nobody to
            wait for (local training, the evaluator).
    """

    def __init__(
        self,
        strategy: Any,
        cluster_spec: ClusterSpec | None,
        task_type: str | None,
        task_id: int | None,
        rpc_layer: str | None = "tcp",
        barrier: Barrier | None = None,
    ):
        self._strategy = strategy
        self._cluster_spec = multi_worker_util.normalize_cluster_spec(cluster_spec)
        self._task_type = task_type
        self._task_id = task_id
        self._rpc_layer = rpc_layer
        self._barrier = barrier

    def __enter__(self) -> WorkerContext:
        current = STATE.worker_context
        if current is not None:
            raise ValueError(
                f"the distribute coordinator cannot run inside a `worker_fn`: this thread already "
                f"runs {current._describe()}; call it once, from the program's top level"
            )
        STATE.worker_context = self
        return self

    def __exit__(self, *exc_info: Any) -> None:
        STATE.worker_context = None

    def _describe(self) -> str:
        if not self._cluster_spec:
            return "[local]"
        return f"[cluster_spec: {self._cluster_spec!r}, task_type: {self._task_type!r}, task_id: {self._task_id!r}]"

    def __repr__(self) -> str:
        return f"WorkerContext{self._describe()}"

    @property
    def task_type(self) -> str | None:
        """The task's type ("chief", "worker", "evaluator"), or None."""
        return self._task_type

    @property
    def task_id(self) -> int | None:
        """The task's index within its job, or None."""
        return self._task_id

    @property
    def cluster_spec(self) -> ClusterSpec:
        """The cluster (empty in local training). ClusterSpec is immutable, so no copy is made."""
        return self._cluster_spec

    @property
    def master_target(self) -> str:
        """URL of this task (``"tcp://host:port"``); "" in local training.

        With no task type (in-graph replication) it is the chief's, or worker 0's.
        """
        if not self._cluster_spec:
            return ""
        if self._task_type is None:
            job, index = multi_worker_util.leader_task(self._cluster_spec)
        else:
            job, index = self._task_type, self._task_id or 0
        return format_master_url(self._cluster_spec.task_address(job, index), self._rpc_layer)

    @property
    def is_chief(self) -> bool:
        """Whether this task is chief: local training, no task type, the chief, the
        evaluator, or worker 0 of a cluster without chief."""
        if not self._cluster_spec or self._task_type in ("chief", "evaluator", None):
            return True
        return "chief" not in self._cluster_spec.jobs and self._task_type == "worker" and self._task_id == 0

    @property
    def num_workers(self) -> int:
        """Number of training workers, chief included (0 in local training)."""
        return multi_worker_util.task_count(self._cluster_spec, "chief") + multi_worker_util.task_count(
            self._cluster_spec, "worker"
        )

    @property
    def distributed_mode(self) -> bool:
        """Whether this task trains in a cluster (False locally and for the evaluator)."""
        return bool(self._cluster_spec) and self._task_type != "evaluator"

    @property
    def has_barrier(self) -> bool:
        """Whether ``wait_for_other_workers`` waits for anyone."""
        return self._barrier is not None

    def wait_for_other_workers(self) -> None:
        """Blocks until every worker of the cluster has reached its own call to this method.

        A real barrier across the worker processes; it returns at once where there is no
        one to wait for (local training, the evaluator).

        Raises:
            ClusterError: if the barrier broke (a worker failed) or timed out.
        """
        if self._barrier is not None:
            self._barrier.wait()

    def _extended(self, name: str) -> bool:
        # Without a strategy the task runs alone, as under the default strategy.
        return True if self._strategy is None else bool(getattr(self._strategy.extended, name))

    @property
    def experimental_should_init(self) -> bool:
        """Whether this task initialises variables (the strategy decides)."""
        return self._extended("experimental_should_init")

    @property
    def should_checkpoint(self) -> bool:
        """Whether this task writes checkpoints (the strategy decides; chief only for
        multi-worker strategies)."""
        return self._extended("should_checkpoint")

    @property
    def should_save_summary(self) -> bool:
        """Whether this task writes summaries (the strategy decides)."""
        return self._extended("should_save_summary")


def run_in_worker_context(
    fn: Callable[[Any], Any],
    strategy: Any,
    cluster_spec: ClusterSpec | None,
    task_type: str | None,
    task_id: int | None,
    rpc_layer: str | None = "tcp",
    barrier: Barrier | None = None,
    *,
    rendezvous: str | None = None,
) -> Any:
    """Configures a copy of ``strategy`` for the task and calls ``fn(strategy)`` in its context.

    The evaluator's strategy (if any) is configured without a cluster: it evaluates on
    its own machine. Other tasks' strategies get ``configure(cluster_spec, task_type,
    task_id)``, and ``rendezvous=`` too where one is given: the ``host:port`` of a store
    opened for the workers' process group (the standalone client's, whose standard
    servers hold the leader's own address). The copy keeps the caller's strategy
    unconfigured, as in the reference.
    """
    if strategy is not None:
        strategy = copy.deepcopy(strategy)
        if task_type == "evaluator":
            strategy.configure()
        else:
            # Only a store someone opened is passed: a strategy without one keeps TF's signature.
            meeting = {"rendezvous": rendezvous} if rendezvous is not None else {}
            strategy.configure(cluster_spec=cluster_spec or None, task_type=task_type, task_id=task_id, **meeting)
    with WorkerContext(strategy, cluster_spec, task_type, task_id, rpc_layer=rpc_layer, barrier=barrier):
        return fn(strategy)
