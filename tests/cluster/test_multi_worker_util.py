"""The reference's cluster rules: chief, worker count, ids, leader, and validation."""

import pytest

from unison import ClusterSpec
from unison._cluster import multi_worker_util as mwu

WITH_CHIEF = {"chief": ["c:1"], "worker": ["w0:1", "w1:1", "w2:1"], "ps": ["p0:1", "p1:1"], "evaluator": ["e:1"]}
NO_CHIEF = {"worker": ["w0:1", "w1:1"], "ps": ["p0:1"]}


def test_normalize_cluster_spec():
    spec = ClusterSpec(NO_CHIEF)
    assert mwu.normalize_cluster_spec(spec) is spec
    assert mwu.normalize_cluster_spec(NO_CHIEF) == spec
    assert mwu.normalize_cluster_spec(None) == ClusterSpec({})
    with pytest.raises(TypeError, match=r"cluster must be a dict .* or a ClusterSpec, got str: 'worker:a:1'"):
        mwu.normalize_cluster_spec("worker:a:1")


@pytest.mark.parametrize(
    "cluster, task_type, task_id, expected",
    [
        (WITH_CHIEF, "chief", 0, True),
        (WITH_CHIEF, "worker", 0, False),
        (WITH_CHIEF, "worker", 2, False),
        (WITH_CHIEF, "ps", 1, False),
        (WITH_CHIEF, "evaluator", 0, True),
        (NO_CHIEF, "worker", 0, True),
        (NO_CHIEF, "worker", 1, False),
        (NO_CHIEF, "ps", 0, False),
        (NO_CHIEF, "evaluator", 0, True),  # the evaluator may be absent from the cluster
        (NO_CHIEF, None, None, False),  # a client is not chief
        ({}, None, None, True),  # local training: the one process is chief
    ],
)
def test_is_chief(cluster, task_type, task_id, expected):
    assert mwu.is_chief(cluster, task_type, task_id) is expected


def test_is_chief_inside_a_worker_context_answers_for_it():
    from unison._coordinator.worker_context import WorkerContext

    with WorkerContext(None, NO_CHIEF, "worker", 1):
        assert mwu.is_chief() is False
    with WorkerContext(None, NO_CHIEF, "worker", 0):
        assert mwu.is_chief() is True


@pytest.mark.parametrize(
    "cluster, task_type, expected",
    [(WITH_CHIEF, "chief", 4), (WITH_CHIEF, "worker", 4), (WITH_CHIEF, "evaluator", 1),
     (NO_CHIEF, "worker", 2), (NO_CHIEF, "evaluator", 1)],
)
def test_worker_count(cluster, task_type, expected):
    assert mwu.worker_count(cluster, task_type) == expected


def test_worker_count_of_ps_is_an_error():
    with pytest.raises(ValueError,
                       match="worker_count is defined for 'chief', 'worker' and 'evaluator' tasks, not 'ps'"):
        mwu.worker_count(WITH_CHIEF, "ps")


@pytest.mark.parametrize(
    "cluster, task_type, task_id, expected",
    [
        (WITH_CHIEF, "chief", 0, 0),
        (WITH_CHIEF, "worker", 0, 1),
        (WITH_CHIEF, "worker", 2, 3),
        (WITH_CHIEF, "evaluator", 0, 0),
        (NO_CHIEF, "worker", 0, 0),
        (NO_CHIEF, "worker", 1, 1),
    ],
)
def test_id_in_cluster(cluster, task_type, task_id, expected):
    assert mwu.id_in_cluster(cluster, task_type, task_id) == expected


def test_ps_has_no_id():
    with pytest.raises(ValueError, match="task type 'ps' has no id in the cluster"):
        mwu.id_in_cluster(WITH_CHIEF, "ps", 0)


@pytest.mark.parametrize(
    "cluster, task_type, task_id, expected",
    [
        (WITH_CHIEF, "worker", 1, "/job:chief/replica:0/task:0"),
        (WITH_CHIEF, "chief", 0, "/job:chief/replica:0/task:0"),
        (NO_CHIEF, "worker", 1, "/job:worker/replica:0/task:0"),
        (NO_CHIEF, "ps", 0, "/job:worker/replica:0/task:0"),
        (WITH_CHIEF, "evaluator", 0, ""),
        ({}, None, None, ""),
    ],
)
def test_collective_leader(cluster, task_type, task_id, expected):
    assert mwu.collective_leader(cluster, task_type, task_id) == expected


def test_leader_needs_chief_or_worker():
    with pytest.raises(ValueError, match="has no 'chief' or 'worker' job"):
        mwu.collective_leader({"ps": ["p:1"]}, "ps", 0)
    assert mwu.leader_task(WITH_CHIEF) == ("chief", 0)
    assert mwu.leader_task(NO_CHIEF) == ("worker", 0)


def test_task_count():
    assert mwu.task_count(WITH_CHIEF, "worker") == 3
    assert mwu.task_count(NO_CHIEF, "chief") == 0


@pytest.mark.parametrize(
    "cluster, task_type, task_id, match",
    [
        ({"trainer": ["a:1"]}, None, None, r"cluster has job 'trainer', which is not a unison task type"),
        ({"chief": ["a:1", "b:1"]}, None, None,
         r"cluster has 2 'chief' tasks \['a:1', 'b:1'\]: there can be at most one chief"),
        ({"worker": ["a:1"], "evaluator": ["e:1", "f:1"]}, None, None, r"at most one evaluator"),
        ({"worker": ["a:1"]}, "master", 0, r"task type 'master' is not one of"),
        ({"worker": ["a:1"]}, "ps", 0, r"task type 'ps' is not a job of the cluster \(jobs: \['worker'\]\)"),
        ({"worker": ["a:1"]}, "worker", 1,
         r"task index 1 is out of range: cluster has 1 'worker' tasks \(valid 0..0\); fix `task_id`"),
        ({"worker": ["a:1"]}, "worker", -1, r"task index -1 is out of range"),
        ({"worker": ["a:1"]}, "worker", "0", r"task index '0' is not an integer"),
        ({"worker": ["a:1"]}, "worker", True, r"task index True is not an integer"),
        ({"worker": ["a:1"]}, "evaluator", 1, r"task index 1 is out of range: cluster has 1 'evaluator' tasks"),
    ],
)
def test_validation_errors(cluster, task_type, task_id, match):
    with pytest.raises(ValueError, match=match):
        mwu.validate_cluster_spec(cluster, task_type, task_id)
    if task_type is not None:  # every rule function applies the same validation
        with pytest.raises(ValueError, match=match):
            mwu.is_chief(cluster, task_type, task_id)


def test_every_function_validates():
    bad = {"chief": ["a:1", "b:1"], "worker": ["c:1"]}
    for call in (
        lambda: mwu.is_chief(bad, "worker", 0),
        lambda: mwu.worker_count(bad, "worker"),
        lambda: mwu.id_in_cluster(bad, "worker", 0),
        lambda: mwu.collective_leader(bad, "worker", 0),
    ):
        with pytest.raises(ValueError, match="at most one chief"):
            call()
