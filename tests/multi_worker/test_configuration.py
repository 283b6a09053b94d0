"""MultiWorkerMirroredStrategy and CommunicationOptions configuration errors (no process group)."""

from __future__ import annotations

import copy
import pickle

import pytest

import unison

CLUSTER = {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"], "ps": ["127.0.0.1:3"]}


@pytest.mark.parametrize("task_type", ["ps", "evaluator"])
def test_tasks_other_than_chief_and_worker_are_refused(task_type):
    spec = dict(CLUSTER, evaluator=["127.0.0.1:4"])
    resolver = unison.SimpleClusterResolver(unison.ClusterSpec(spec), task_type=task_type, task_id=0)
    with pytest.raises(ValueError, match=rf"runs on 'chief' and 'worker' tasks, got task_type '{task_type}'"):
        unison.MultiWorkerMirroredStrategy(resolver)


def test_cluster_place_is_known_before_any_connection():
    resolver = unison.SimpleClusterResolver(unison.ClusterSpec(CLUSTER), task_type="worker", task_id=0)
    strategy = unison.MultiWorkerMirroredStrategy(resolver)  # nothing listens at these addresses
    assert strategy.num_replicas_in_sync == 2
    assert not strategy.extended.should_checkpoint  # the chief checkpoints, not worker 0
    assert strategy.extended.experimental_between_graph


def test_local_strategy_without_cluster_and_copies():
    strategy = unison.MultiWorkerMirroredStrategy(unison.SimpleClusterResolver(unison.ClusterSpec({})))
    assert strategy.num_replicas_in_sync == 1 and strategy.extended.should_checkpoint
    for clone in (copy.deepcopy(strategy), pickle.loads(pickle.dumps(strategy))):
        assert isinstance(clone, unison.MultiWorkerMirroredStrategy) and clone is not strategy
        assert clone.num_replicas_in_sync == 1


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"bytes_per_pack": -1}, r"bytes_per_pack must be an int >= 0, got -1"),
        ({"timeout_seconds": 0}, r"timeout_seconds must be > 0 or None, got 0"),
        ({"implementation": "carrier-pigeon"}, r"implementation 'carrier-pigeon' is not a CommunicationImplementation"),
    ],
)
def test_bad_communication_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        unison.CommunicationOptions(**kwargs)


def test_nccl_needs_cuda_devices():
    resolver = unison.SimpleClusterResolver(unison.ClusterSpec({"worker": ["127.0.0.1:1", "127.0.0.1:2"]}),
                                            task_type="worker", task_id=0)
    with pytest.raises(ValueError, match=r"CommunicationImplementation.NCCL needs CUDA replica devices"):
        unison.MultiWorkerMirroredStrategy(resolver, unison.CommunicationOptions(implementation="nccl"), devices=["cpu:0"])
