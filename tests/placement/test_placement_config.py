"""PlacementConfig: validation, and counting a cluster the way multi_worker_util does."""

from __future__ import annotations

import re

import pytest

import unison
from unison._coordinator.worker_context import WorkerContext
from unison.placement import PlacementConfig

CLUSTER = {
    "chief": ["localhost:1000"],
    "worker": ["localhost:1001", "localhost:1002", "localhost:1003"],
    "ps": ["localhost:1004", "localhost:1005"],
    "evaluator": ["localhost:1006"],
}


def test_defaults_and_frozen():
    config = PlacementConfig()
    assert (config.num_worker_replicas, config.global_id_in_cluster, config.num_ps_replicas) == (1, None, 0)
    assert config.worker_index == 0
    with pytest.raises(AttributeError):
        config.num_ps_replicas = 3  # frozen


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_worker_replicas": 0}, "num_worker_replicas must be an integer >= 1.*got 0.*fix `num_worker_replicas`"),
        ({"num_worker_replicas": -2}, "num_worker_replicas must be an integer >= 1.*got -2"),
        ({"num_worker_replicas": True}, "num_worker_replicas must be an integer >= 1.*got True"),
        ({"num_worker_replicas": "3"}, "num_worker_replicas must be an integer >= 1.*got '3'"),
        ({"num_ps_replicas": -1}, "num_ps_replicas must be an integer >= 0, got -1.*fix `num_ps_replicas`"),
        ({"num_worker_replicas": 2, "global_id_in_cluster": 2},
         r"global_id_in_cluster 2 is out of range: the cluster has 2 worker\(s\) \(valid 0\.\.1"
         r".*fix `global_id_in_cluster`"),
        ({"num_worker_replicas": 2, "global_id_in_cluster": -1}, "global_id_in_cluster -1 is out of range"),
        ({"global_id_in_cluster": 0.0}, r"global_id_in_cluster 0\.0 is out of range"),
    ],
)
def test_bad_values_name_field_value_and_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PlacementConfig(**kwargs)


@pytest.mark.parametrize(
    "task_type, task_id, expected",
    [
        ("chief", 0, (4, 0, 2)),  # the chief is worker 0
        ("worker", 0, (4, 1, 2)),
        ("worker", 2, (4, 3, 2)),
        ("evaluator", 0, (1, 0, 0)),  # alone in a cluster of its own
        (None, None, (4, None, 2)),  # a client: counts as worker 0
    ],
)
def test_from_cluster_spec_counts_like_multi_worker_util(task_type, task_id, expected):
    config = PlacementConfig.from_cluster_spec(CLUSTER, task_type, task_id)
    assert (config.num_worker_replicas, config.global_id_in_cluster, config.num_ps_replicas) == expected


def test_without_a_chief_worker_zero_is_worker_zero():
    cluster = {"worker": ["a:1", "b:1", "c:1"], "ps": ["d:1"]}
    assert PlacementConfig.from_cluster_spec(cluster, "worker", 0) == PlacementConfig(3, 0, 1)
    assert PlacementConfig.from_cluster_spec(cluster, "worker", 2) == PlacementConfig(3, 2, 1)


def test_empty_cluster_is_local_training():
    assert PlacementConfig.from_cluster_spec({}) == PlacementConfig(1, 0, 0)
    assert PlacementConfig.from_cluster_spec(None) == PlacementConfig(1, 0, 0)


def test_ps_task_and_bad_clusters_raise_value_errors():
    with pytest.raises(ValueError, match=r"task \('ps', 1\) has no ensemble placement.*fix `task_type`"):
        PlacementConfig.from_cluster_spec(CLUSTER, "ps", 1)
    with pytest.raises(ValueError, match=r"task index 4 is out of range: cluster has 3 'worker' tasks"):
        PlacementConfig.from_cluster_spec(CLUSTER, "worker", 4)
    with pytest.raises(ValueError, match=r"has no 'chief' or 'worker' task.*add `cluster.worker`"):
        PlacementConfig.from_cluster_spec({"ps": ["a:1"]})


def test_from_cluster_resolver():
    resolver = unison.SimpleClusterResolver(CLUSTER, task_type="worker", task_id=1)
    assert PlacementConfig.from_cluster_resolver(resolver) == PlacementConfig(4, 2, 2)
    with pytest.raises(TypeError, match=re.escape("needs a unison.ClusterResolver, got dict")):
        PlacementConfig.from_cluster_resolver(CLUSTER)


def test_from_strategy_uses_the_strategy_resolver():
    resolver = unison.SimpleClusterResolver(CLUSTER, task_type="worker", task_id=2)
    strategy = unison.MultiWorkerMirroredStrategy(resolver)  # the group forms lazily: nothing connects here
    assert PlacementConfig.from_strategy(strategy) == PlacementConfig(4, 3, 2)
    local = unison.MultiWorkerMirroredStrategy(unison.SimpleClusterResolver({}))
    assert PlacementConfig.from_strategy(local) == PlacementConfig(1, 0, 0)


def test_from_strategy_of_local_strategies_is_one_worker_without_ps():
    for strategy in (unison.MirroredStrategy(["cpu:0", "cpu:1"]), unison.OneDeviceStrategy("cpu:0"),
                     unison.get_strategy()):
        assert PlacementConfig.from_strategy(strategy) == PlacementConfig(1, 0, 0)
    with pytest.raises(TypeError, match="needs a unison.Strategy, got str"):
        PlacementConfig.from_strategy("mirrored")


def test_from_strategy_inside_a_coordinator_worker_context_uses_its_cluster():
    # The coordinator configures the strategy with this cluster; the strategy's own resolver
    # (here: local) saw none of it.
    strategy = unison.MultiWorkerMirroredStrategy(unison.SimpleClusterResolver({}))
    with WorkerContext(strategy, unison.ClusterSpec(CLUSTER), "worker", 0):
        assert PlacementConfig.from_strategy(strategy) == PlacementConfig(4, 1, 2)
    assert PlacementConfig.from_strategy(strategy) == PlacementConfig(1, 0, 0)
