"""MultiWorkerMirroredStrategy and CommunicationOptions configuration errors (no process group)."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest
import torch

import unison
from unison._cluster.resolved import ResolvedCluster
from unison._collectives.group.process_group import choose_backend

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
        unison.MultiWorkerMirroredStrategy(resolver, unison.CommunicationOptions(implementation="nccl"),
                                           devices=["cpu:0"])


def _cluster(hosts, rank):
    spec = unison.ClusterSpec({"worker": [f"{h}:{2000 + i}" for i, h in enumerate(hosts)]})
    return unison.SimpleClusterResolver(spec, task_type="worker", task_id=rank).resolve()


def test_host_placement_counts_the_training_tasks_on_this_tasks_host():
    hosts = ["10.0.0.1", "10.0.0.2", "10.0.0.1", "10.0.0.1"]
    assert [_cluster(hosts, r).host_placement for r in range(4)] == [(0, 3), (0, 1), (1, 3), (2, 3)]
    assert ResolvedCluster.local().host_placement == (0, 1)


@pytest.fixture
def gpus(monkeypatch):
    """Pretends this machine has ``n`` CUDA devices and NCCL (no device is touched)."""
    def set_count(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    return set_count


@pytest.mark.parametrize("count, hosts, want", [
    (0, ["a"], [("cpu:0",)]),
    (2, ["a"], [("cuda:0", "cuda:1")]),                               # alone on its host: every GPU
    (4, ["a", "a"], [("cuda:0", "cuda:1"), ("cuda:2", "cuda:3")]),    # equal disjoint shares
    (2, ["a", "a", "a"], [("cuda:0",), ("cuda:1",), ("cuda:0",)]),    # fewer GPUs than workers
    (1, ["a", "b"], [("cuda:0",), ("cuda:0",)]),                      # one worker per host
])
def testdefault_devices_split_the_hosts_gpus_between_its_workers(gpus, count, hosts, want):
    from unison._strategies.multi_worker import default_devices

    gpus(count)
    assert [default_devices(_cluster(hosts, r)) for r in range(len(hosts))] == want


def test_the_local_rank_picks_one_gpu(gpus):
    from unison._strategies.multi_worker import default_devices

    gpus(2)
    cluster = dataclasses.replace(_cluster(["a", "a", "a"], 2), local_rank=5)
    assert default_devices(cluster) == ("cuda:1",)


@pytest.mark.parametrize("implementation, count, sharing, want", [
    ("AUTO", 2, 2, "nccl"), ("AUTO", 1, 2, "gloo"), ("AUTO", 1, 1, "nccl"), ("RING", 2, 2, "gloo"),
    ("NCCL", 2, 2, "nccl"),
])
def test_nccl_only_where_every_worker_of_the_host_has_a_gpu(gpus, implementation, count, sharing, want):
    gpus(count)
    options = unison.CommunicationOptions(implementation=implementation)
    assert choose_backend(["cuda:0"], options, sharing) == want


def test_nccl_with_more_workers_than_gpus_on_a_host_names_the_fix(gpus):
    gpus(1)
    with pytest.raises(ValueError, match=r"NCCL needs one GPU per worker, but 2 workers share this host and it has "
                                         r"1 GPU\(s\); run at most 1 workers per host, or use RING or AUTO"):
        choose_backend(["cuda:0"], unison.CommunicationOptions(implementation="nccl"), 2)


def test_gloo_between_gpu_replicas_uses_packed_collectives_not_shared_memory():
    from unison._collectives.transport.cross_worker import PackedTransport, SharedMemoryTransport, choose_transport

    options = unison.CommunicationOptions()
    assert type(choose_transport(None, options, "gloo", ["a", "a"])) is SharedMemoryTransport
    assert type(choose_transport(None, options, "gloo", ["a", "a"], replicas_on_cuda=True)) is PackedTransport
