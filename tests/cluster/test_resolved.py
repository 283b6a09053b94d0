"""One resolved cluster: built from one read of the environment and consumed everywhere."""

from __future__ import annotations

import json

import pytest

import unison
from unison._cluster import multi_worker_util, tf_config
from unison._cluster.resolved import RendezvousKind, ResolvedCluster
from unison._cluster.scheduler import LAUNCH
from unison._cluster.slurm import SLURM
from unison._cluster.spec import ClusterSpec
from unison._cluster.torchrun import TORCHRUN

TWO_WORKERS = {"cluster": {"worker": ["127.0.0.1:2000", "127.0.0.1:2001"]}, "task": {"type": "worker", "index": 1}}


def test_building_a_multi_worker_strategy_parses_tf_config_once(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", json.dumps(TWO_WORKERS))
    monkeypatch.delenv("UNISON_RENDEZVOUS", raising=False)
    tf_config._parse_cached.cache_clear()
    counts = {"json.loads": 0, "parse_tf_config": 0, "validate_cluster_spec": 0}

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(tf_config.json, "loads", counting("json.loads", json.loads))
    monkeypatch.setattr(tf_config, "parse_tf_config", counting("parse_tf_config", tf_config.parse_tf_config))
    monkeypatch.setattr(multi_worker_util, "validate_cluster_spec",
                        counting("validate_cluster_spec", multi_worker_util.validate_cluster_spec))
    strategy = unison.MultiWorkerMirroredStrategy()  # the group forms on first use: nothing connects here
    assert counts["json.loads"] == 1 and counts["parse_tf_config"] == 1, counts
    # the parse checks cluster, then task; the resolution once (was 10)
    assert counts["validate_cluster_spec"] <= 3, counts
    cluster = strategy.extended.components.cluster
    assert (cluster.rank, cluster.task_names, cluster.leader_address) == (1, ("worker:0", "worker:1"), "127.0.0.1:2000")
    assert strategy.cluster_resolver is not None


def test_resolution_derives_rank_names_leader_and_chief():
    spec = ClusterSpec({"chief": ["h:1"], "worker": ["h:2", "h:3"], "ps": ["h:4"]})
    worker = ResolvedCluster.build(spec, "worker", 1, environ={})
    assert (worker.rank, worker.world_size, worker.is_chief) == (2, 3, False)
    assert worker.task_names == ("chief:0", "worker:0", "worker:1")
    assert worker.rendezvous is RendezvousKind.LEADER and worker.rendezvous_address == "h:1"
    chief = ResolvedCluster.build(spec, "chief", 0, environ={})
    assert (chief.rank, chief.is_chief) == (0, True)
    ps = ResolvedCluster.build(spec, "ps", 0, environ={})
    assert (ps.rank, ps.rendezvous, ps.is_chief) == (None, RendezvousKind.NONE, False)


def test_resolution_reads_the_rendezvous_store_local_rank_and_restart_count():
    spec = ClusterSpec({"worker": ["h:1", "h:2"]})
    environ = {"UNISON_RENDEZVOUS": "127.0.0.1:5555", "LOCAL_RANK": "1", "UNISON_RESTART_COUNT": "2"}
    cluster = ResolvedCluster.build(spec, "worker", 0, scheduler=TORCHRUN, environ=environ)
    assert (cluster.rendezvous, cluster.rendezvous_address) == (RendezvousKind.STORE, "127.0.0.1:5555")
    assert (cluster.local_rank, cluster.restart_count, cluster.is_chief) == (1, 2, True)
    torchrun = ResolvedCluster.build(spec, "worker", 0, scheduler=TORCHRUN, environ={"LOCAL_RANK": "0"})
    assert torchrun.rendezvous is RendezvousKind.TORCHRUN
    slurm = ResolvedCluster.build(spec, "worker", 1, scheduler=SLURM, environ={"SLURM_LOCALID": "3"})
    assert slurm.local_rank == 3 and slurm.rendezvous is RendezvousKind.LEADER
    launch = ResolvedCluster.build(spec, "worker", 1, environ={"SLURM_LOCALID": "3", "LOCAL_RANK": "2"})
    assert launch.local_rank is None and launch.rendezvous is RendezvousKind.LEADER  # no scheduler's variables


def test_an_explicit_rendezvous_store_wins_over_the_environment():
    spec = ClusterSpec({"worker": ["h:1", "h:2"]})
    environ = {"UNISON_RENDEZVOUS": "127.0.0.1:5555"}
    cluster = ResolvedCluster.build(spec, "worker", 1, scheduler=TORCHRUN, environ=environ, rendezvous="10.0.0.9:7")
    assert (cluster.rendezvous, cluster.rendezvous_address) == (RendezvousKind.STORE, "10.0.0.9:7")
    resolver = unison.SimpleClusterResolver(spec, task_type="worker", task_id=0)
    resolved = resolver.resolve(environ={}, rendezvous="10.0.0.9:7")
    assert (resolved.rendezvous, resolved.rendezvous_address) == (RendezvousKind.STORE, "10.0.0.9:7")
    ps = ResolvedCluster.build(ClusterSpec({"worker": ["h:1"], "ps": ["h:3"]}), "ps", 0, environ={}, rendezvous="x:1")
    assert ps.rendezvous is RendezvousKind.NONE  # a task that does not train meets nobody


@pytest.mark.parametrize("name, scheduler", [("torchrun", TORCHRUN), ("slurm", SLURM), ("cloud", LAUNCH), ("", LAUNCH)])
def test_a_resolver_that_only_names_its_environment_gets_that_schedulers_conventions(name, scheduler):
    spec = {"worker": ["h:1", "h:2"]}
    simple = unison.SimpleClusterResolver(spec, task_type="worker", task_id=0, environment=name)
    config = {"TF_CONFIG": json.dumps({"cluster": spec, "task": {"type": "worker", "index": 0}, "environment": name})}
    assert simple.scheduler == scheduler and unison.TFConfigClusterResolver(environ=config).scheduler == scheduler
    assert tf_config.resolve_task(None, None, None, "tcp", environ=config).scheduler == scheduler
    assert simple.resolve(environ={}).scheduler == scheduler  # carried: a lost peer's advice comes from it


def test_local_training_resolves_to_one_worker():
    cluster = unison.SimpleClusterResolver().resolve(environ={})
    assert cluster.is_local and cluster.world_size == 1 and cluster.rank is None and cluster.is_chief


def test_a_malformed_restart_count_names_the_variable():
    with pytest.raises(ValueError, match=r"UNISON_RESTART_COUNT='x'"):
        ResolvedCluster.build(ClusterSpec({}), None, None, environ={"UNISON_RESTART_COUNT": "x"})


def test_nothing_outside_cluster_reads_cluster_variables():
    """Only ``unison._cluster`` reads TF_CONFIG, torchrun/SLURM variables and unison's own."""
    import pathlib
    import re

    root = pathlib.Path(unison.__file__).parent
    reads = re.compile(r"os\.environ(\.get)?\s*[\[(]\s*[\"']"
                       r"(TF_CONFIG|RANK|WORLD_SIZE|LOCAL_RANK|MASTER_|SLURM_|UNISON_)"
                       r"|os\.getenv\(\s*[\"'](TF_CONFIG|SLURM_|UNISON_|LOCAL_RANK)")
    offenders = [str(path.relative_to(root)) for path in root.rglob("*.py")
                 if "cluster" not in path.relative_to(root).parts and reads.search(path.read_text())]
    assert not offenders, offenders


@pytest.mark.parametrize("value, shared", [(None, True), ("1", True), ("0", False), (" 0 ", False)])
def test_ps_shared_memory_is_on_unless_the_variable_says_0(value, shared):
    from unison._cluster.env import ps_shared_memory

    assert ps_shared_memory({} if value is None else {"UNISON_PS_SHARED_MEMORY": value}) is shared
