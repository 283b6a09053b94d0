"""The rules of a multi-worker cluster: which task is chief, who leads, how tasks count.

These small functions are where the cluster's roles are decided, so that strategies,
the coordinator and checkpointing all agree: at most one chief and one evaluator; the
chief (or worker 0 when there is no chief) is the chief and the collective leader;
workers are numbered after the chief; the evaluator lives in a cluster of its own.

tf.distribute equivalent: ``tensorflow/python/distribute/multi_worker_util.py``.
"""

from __future__ import annotations

from unison._cluster.spec import ClusterLike, ClusterSpec
from unison._state import STATE

__all__ = [
    "TASK_TYPES",
    "normalize_cluster_spec",
    "validate_cluster_spec",
    "task_count",
    "is_chief",
    "worker_count",
    "id_in_cluster",
    "collective_leader",
    "leader_task",
]

#: The task types a unison cluster may have (plus ``None`` for a client).
TASK_TYPES = ("chief", "worker", "ps", "evaluator")


def normalize_cluster_spec(cluster_spec: ClusterLike | None) -> ClusterSpec:
    """Returns ``cluster_spec`` as a ClusterSpec (``None`` is the empty cluster).

    Raises:
        TypeError: if it is neither a mapping nor a ClusterSpec.
        ValueError: if the mapping is not a valid cluster (see ClusterSpec).
    """
    if isinstance(cluster_spec, ClusterSpec):
        return cluster_spec
    return ClusterSpec(cluster_spec)


def task_count(cluster_spec: ClusterLike, task_type: str) -> int:
    """Number of tasks of ``task_type`` in the cluster (0 when it has no such job)."""
    spec = normalize_cluster_spec(cluster_spec)
    return spec.num_tasks(task_type) if task_type in spec.jobs else 0


def validate_cluster_spec(
    cluster_spec: ClusterLike | None,
    task_type: str | None,
    task_id: int | None,
    *,
    source: str = "",
    type_field: str = "task_type",
    id_field: str = "task_id",
) -> ClusterSpec:
    """Checks a cluster and the current task against the rules of a unison cluster.

    Rules: jobs are among ``TASK_TYPES``; at most one chief and one evaluator; the task
    type is one of ``TASK_TYPES`` (or ``None`` for a client) and is a job of the cluster,
    except "evaluator", which may be absent (it runs on its own); the task id is an
    integer in range (0 for an evaluator outside the cluster).

    Args:
        cluster_spec: the cluster.
        task_type: the current task's type, or None for a client.
        task_id: the current task's index; ignored when ``task_type`` is None.
        source: prefix for messages, e.g. ``"TF_CONFIG "``.
        type_field: how the caller names the task type in a "fix" hint.
        id_field: how the caller names the task id in a "fix" hint.

    Returns:
        The cluster as a ClusterSpec.

    Raises:
        ValueError: naming the rule broken, the value and the field to fix.
    """
    spec = normalize_cluster_spec(cluster_spec)
    for job in spec.jobs:
        if job not in TASK_TYPES:
            raise ValueError(
                f"{source}cluster has job {job!r}, which is not a unison task type "
                f"{TASK_TYPES!r}; fix `cluster.{job}` (rename or remove it)"
            )
    for job in ("chief", "evaluator"):
        if task_count(spec, job) > 1:
            raise ValueError(
                f"{source}cluster has {spec.num_tasks(job)} {job!r} tasks "
                f"{spec.job_tasks(job)!r}: there can be at most one {job}; fix `cluster.{job}`"
            )
    if task_type is None:
        return spec
    if task_type not in TASK_TYPES:
        raise ValueError(
            f"{source}task type {task_type!r} is not one of {TASK_TYPES!r}; fix `{type_field}`"
        )
    if task_type not in spec.jobs and task_type != "evaluator":
        raise ValueError(
            f"{source}task type {task_type!r} is not a job of the cluster (jobs: {spec.jobs!r}); "
            f"fix `{type_field}` or add `cluster.{task_type}`"
        )
    if isinstance(task_id, bool) or not isinstance(task_id, int):
        raise ValueError(
            f"{source}task index {task_id!r} is not an integer; fix `{id_field}`, e.g. 0"
        )
    count = task_count(spec, task_type) or 1  # an evaluator outside the cluster is alone
    if not 0 <= task_id < count:
        raise ValueError(
            f"{source}task index {task_id!r} is out of range: cluster has {count} {task_type!r} "
            f"tasks (valid 0..{count - 1}); fix `{id_field}`"
        )
    return spec


def is_chief(
    cluster_spec: ClusterLike | None = None,
    task_type: str | None = None,
    task_id: int | None = None,
) -> bool:
    """Whether the task is the chief: it writes checkpoints and summaries.

    The chief task is chief; so is the evaluator (it is alone in its own cluster);
    without a chief job, worker 0 is chief. Called with no cluster inside a
    ``worker_fn``, answers for the current worker context; with an empty cluster (local
    training) the one process is chief.

    tf.distribute equivalent: ``multi_worker_util.is_chief``; the local case differs.

    Raises:
        ValueError: if the cluster or task breaks the rules of ``validate_cluster_spec``.
    """
    if cluster_spec is None:
        context = STATE.worker_context
        if context is not None:
            return bool(context.is_chief)
    spec = validate_cluster_spec(cluster_spec, task_type, task_id)
    if not spec:
        return True
    if task_type in ("chief", "evaluator"):
        return True
    return "chief" not in spec.jobs and task_type == "worker" and task_id == 0


def worker_count(cluster_spec: ClusterLike, task_type: str) -> int:
    """Number of workers that train together, the chief included.

    For an evaluator this is 1: it evaluates on its own.

    Raises:
        ValueError: for a task type other than chief, worker or evaluator, or an invalid
            cluster.
    """
    spec = validate_cluster_spec(cluster_spec, task_type, 0)
    if task_type not in ("chief", "worker", "evaluator"):
        raise ValueError(
            f"worker_count is defined for 'chief', 'worker' and 'evaluator' tasks, not "
            f"{task_type!r}; fix `task_type`"
        )
    if task_type == "evaluator":
        return 1
    return task_count(spec, "chief") + task_count(spec, "worker")


def id_in_cluster(cluster_spec: ClusterLike, task_type: str, task_id: int) -> int:
    """The task's rank among the training workers: chief 0, then workers in order.

    An evaluator has id ``task_id`` (0) in its own cluster. This id is the input
    pipeline id and the process-group rank.

    Raises:
        ValueError: for a ps task (it has no id) or an invalid cluster or task.
    """
    spec = validate_cluster_spec(cluster_spec, task_type, task_id)
    if task_type == "chief":
        return 0
    if task_type == "worker":
        return task_id + task_count(spec, "chief")
    if task_type == "evaluator":
        return task_id
    raise ValueError(
        f"task type {task_type!r} has no id in the cluster: only 'chief', 'worker' and "
        f"'evaluator' tasks have one"
    )


def leader_task(cluster_spec: ClusterLike) -> tuple[str, int]:
    """The ``(task_type, task_id)`` that leads collectives: the chief, else worker 0.

    Raises:
        ValueError: if the cluster has neither a chief nor a worker job.
    """
    spec = normalize_cluster_spec(cluster_spec)
    if "chief" in spec.jobs:
        return ("chief", 0)
    if "worker" in spec.jobs:
        return ("worker", 0)
    raise ValueError(
        f"cluster {spec.as_dict()!r} has no 'chief' or 'worker' job, so no task can lead "
        f"the workers; add `cluster.worker` (or `cluster.chief`)"
    )


def collective_leader(cluster_spec: ClusterLike, task_type: str | None, task_id: int | None) -> str:
    """The device name of the task that leads collectives, e.g. ``"/job:chief/replica:0/task:0"``.

    Empty for local training and for the evaluator (it takes part in no collective).

    Raises:
        ValueError: for an invalid cluster or task, or a cluster without chief and worker.
    """
    spec = normalize_cluster_spec(cluster_spec)
    if not spec:
        return ""
    validate_cluster_spec(spec, task_type, task_id)
    if task_type == "evaluator":
        return ""
    job, index = leader_task(spec)
    return f"/job:{job}/replica:0/task:{index}"
