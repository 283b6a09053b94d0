"""SLURM as it really runs: ports from the job step, MASTER_ADDR/MASTER_PORT, the store
token, the sbatch-without-srun case, the thread default and the restart advice. No
SLURM install is needed: the environments are the ones srun and sbatch set."""

from __future__ import annotations

import doctest
import json
import socket
import time
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import unison
from unison._cluster import known_schedulers, sagemaker, slurm, union
from unison._cluster.resolved import RendezvousKind
from unison._cluster.slurm import PORT_LOW, PORT_SLOTS, PORT_STRIDE, SlurmClusterResolver, rendezvous_port
from unison._cluster.threads import ThreadDefault, ThreadsDefaultWarning, cpu_share
from unison._cluster.torchrun import TorchrunClusterResolver
from unison._collectives.group.process_group import WorkerGroup, store_prefix
from unison.errors import ClusterError

# What `srun -N 2 -n 4` sets in task 3 (job 4242, its first step).
SRUN = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_NTASKS": "4",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_JOB_NODELIST": "node[01-02]",
    "SLURM_STEP_NODELIST": "node[01-02]",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    "SLURM_TASKS_PER_NODE": "2(x2)",
}

# What torchrun sets in its second process.
TORCHRUN_ENV = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}

# What the batch script of `sbatch -n 2` sees: the allocation, rank 0, and no step.
SBATCH = {
    "SLURM_JOB_ID": "4243",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NTASKS": "2",
    "SLURM_JOB_NODELIST": "node01",
    "SLURM_NODELIST": "node01",
    "SLURM_TASKS_PER_NODE": "2",
}


def test_port_is_derived_from_the_job_and_step_ids():
    spec = SlurmClusterResolver(environ=SRUN).cluster_spec()
    base = rendezvous_port(4242, 0)
    assert spec.job_tasks("worker") == [f"node01:{base}", f"node01:{base + 1}", f"node02:{base}", f"node02:{base + 1}"]
    next_step = SlurmClusterResolver(environ={**SRUN, "SLURM_STEP_ID": "1"}).cluster_spec()
    next_job = SlurmClusterResolver(environ={**SRUN, "SLURM_JOB_ID": "4243"}).cluster_spec()
    assert len({spec.task_address("worker", 0), next_step.task_address("worker", 0),
                next_job.task_address("worker", 0)}) == 3
    assert base != 8888


@given(job=st.integers(0, 10**9))
def test_the_steps_of_a_job_and_consecutive_jobs_get_separate_port_windows(job):
    ports = [rendezvous_port(job, step) for step in range(16)] + [rendezvous_port(job + 1, 0)]
    assert len(set(ports)) == len(ports)
    assert all(PORT_LOW <= p and p + PORT_STRIDE - 1 < PORT_LOW + PORT_SLOTS * PORT_STRIDE <= 65535 for p in ports)
    assert all(abs(a - b) >= PORT_STRIDE for a in ports for b in ports if a != b)


def test_master_port_and_port_base_take_precedence():
    assert SlurmClusterResolver(environ={**SRUN, "MASTER_PORT": "31000"}).cluster_spec().task_address("worker", 3) \
        == "node02:31001"
    explicit = SlurmClusterResolver(port_base=9000, environ={**SRUN, "MASTER_PORT": "31000"})
    assert explicit.cluster_spec().task_address("worker", 0) == "node01:9000"
    with pytest.raises(ValueError, match=r"MASTER_PORT='x' is not a port"):
        SlurmClusterResolver(environ={**SRUN, "MASTER_PORT": "x"}).cluster_spec()
    with pytest.raises(ValueError, match=r"SLURM_JOB_ID=None is not a job number.*set MASTER_PORT"):
        SlurmClusterResolver(environ={k: v for k, v in SRUN.items() if k != "SLURM_JOB_ID"}).cluster_spec()


def test_master_addr_replaces_the_first_nodes_name():
    resolver = SlurmClusterResolver(environ={**SRUN, "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "31000"})
    assert resolver.cluster_spec().job_tasks("worker") == ["10.1.2.3:31000", "10.1.2.3:31001", "node02:31000",
                                                           "node02:31001"]
    resolved = resolver.resolve(environ={**SRUN, "MASTER_ADDR": "10.1.2.3"})
    assert resolved.rendezvous_address == "10.1.2.3:31000" and resolved.rendezvous is RendezvousKind.LEADER


def test_the_store_token_names_the_job_step():
    resolved = SlurmClusterResolver(environ=SRUN).resolve(environ=SRUN)
    assert resolved.rendezvous_token == "slurm-job4242-step0"
    assert store_prefix(resolved) == "unison/slurm-job4242-step0"
    other = SlurmClusterResolver(environ={**SRUN, "SLURM_STEP_ID": "1"}).resolve(environ={**SRUN, "SLURM_STEP_ID": "1"})
    assert other.rendezvous_token != resolved.rendezvous_token
    local = unison.SimpleClusterResolver({"worker": ["a:1"]}, task_type="worker", task_id=0).resolve(environ=SRUN)
    assert local.rendezvous_token == "" and store_prefix(local) == "unison"


def test_python_in_an_sbatch_script_without_srun_is_told_to_use_srun_at_once(monkeypatch):
    for name in list(__import__("os").environ):
        if name.startswith(("SLURM_", "TF_CONFIG", "UNISON_")) or name in ("RANK", "WORLD_SIZE", "MASTER_PORT"):
            monkeypatch.delenv(name)
    for name, value in SBATCH.items():
        monkeypatch.setenv(name, value)
    start = time.monotonic()
    with pytest.raises(ClusterError, match=r"SLURM_PROCID=0 and SLURM_NTASKS=2 but no job step.*run it under `srun`"):
        unison.MultiWorkerMirroredStrategy()
    # At once, not after the 300 s default collective timeout; 60 s leaves a busy machine room.
    assert time.monotonic() - start < 60
    # One task in the batch script is a legitimate job of one.
    monkeypatch.setenv("SLURM_NTASKS", "1")
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "1")
    assert SlurmClusterResolver().resolve().world_size == 1


def test_unison_launch_or_torchrun_inside_an_sbatch_script_win_over_slurm():
    tf_config = {"TF_CONFIG": json.dumps({"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
                                          "task": {"type": "worker", "index": 1}})}
    resolved = unison.detect_cluster_resolver(environ={**SBATCH, **tf_config}).resolve(environ={**SBATCH, **tf_config})
    assert resolved.environment == "" and resolved.rank == 1 and resolved.cpu_share is None
    torchrun = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    resolver = unison.detect_cluster_resolver(environ={**SRUN, **torchrun})
    assert resolver.environment == "torchrun"
    assert resolver.resolve(environ={**SRUN, **torchrun}).rendezvous is RendezvousKind.TORCHRUN


def test_cpu_share_from_cpus_per_task_or_affinity():
    assert cpu_share(4, tasks_on_host=2, affinity=16) == 4
    assert cpu_share(None, tasks_on_host=2, affinity=16) == 8
    assert cpu_share(None, tasks_on_host=4, affinity=2) == 1
    assert cpu_share(32, tasks_on_host=1, affinity=8) == 8
    resolved = SlurmClusterResolver(environ=SRUN).resolve(environ={**SRUN, "SLURM_CPUS_PER_TASK": "3"})
    assert resolved.cpu_share == min(3, cpu_share(None, 1))
    resolved = SlurmClusterResolver(environ=SRUN).resolve(environ=SRUN)
    assert resolved.cpu_share == cpu_share(None, tasks_on_host=2)  # 2 tasks on node02


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_thread_default_lowers_threads_once_and_says_so(restore_threads):
    torch.set_num_threads(4)
    default = ThreadDefault()
    with pytest.warns(ThreadsDefaultWarning, match=r"set torch's intra-op threads of worker:1 to 2 .* from 4"):
        assert default.apply(2, "worker:1", environ={}) == 2
    assert torch.get_num_threads() == 2
    torch.set_num_threads(4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert default.apply(2, "worker:1", environ={}) is None  # at most once per process
    assert torch.get_num_threads() == 4


def test_thread_default_leaves_a_users_choice_alone(restore_threads):
    torch.set_num_threads(4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ThreadDefault().apply(1, "worker:0", environ={"OMP_NUM_THREADS": "4"}) is None
        chosen = ThreadDefault()
        torch.set_num_threads(3)  # the user's call after unison was imported
        assert chosen.apply(1, "worker:0", environ={}) is None
        assert ThreadDefault().apply(None, "worker:0", environ={}) is None  # no share known (not SLURM)
        assert ThreadDefault().apply(8, "worker:0", environ={}) is None  # never raised
    assert torch.get_num_threads() == 3


def test_peer_lost_advice_follows_the_scheduler():
    def advice(resolver) -> str:
        cluster = resolver.resolve(environ={**SRUN, **TORCHRUN_ENV})
        group = WorkerGroup(None, None, 0, 2, ["worker:0", "worker:1"], "gloo", 5.0, None,
                            cluster.scheduler.restart_advice())
        return str(group.lost_peer_error("all_reduce", RuntimeError("closed")))

    slurm_advice = advice(SlurmClusterResolver(environ=SRUN))
    assert "srun -K" in slurm_advice and "scontrol requeue" in slurm_advice and "--max-restarts" not in slurm_advice
    assert "torchrun's `--max-restarts=N`" in advice(TorchrunClusterResolver(environ=TORCHRUN_ENV))
    tf_config = {"TF_CONFIG": json.dumps({"cluster": {"worker": ["a:1", "b:1"]},
                                          "task": {"type": "worker", "index": 0}})}
    assert "unison launch --max-restarts" in advice(unison.TFConfigClusterResolver(environ=tf_config))
    default = WorkerGroup(None, None, 0, 2, ["worker:0", "worker:1"], "gloo", 5.0, None)
    assert "unison launch --max-restarts" in str(default.lost_peer_error("all_reduce", RuntimeError("closed")))


@pytest.mark.parametrize("module", [slurm, union, sagemaker, known_schedulers])
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0, result


def test_a_leader_name_that_does_not_resolve_is_named_with_the_override(monkeypatch):
    """The resolver says no at once here (no network, no DNS server that may be slow or
    unreachable); the rendezvous must then fail on that first answer, not retry until
    its 30 s timeout."""
    from unison._collectives.group.store_connect import join_rendezvous

    lookups = []
    real_getaddrinfo = socket.getaddrinfo

    def getaddrinfo(host, *args, **kwargs):
        if host != "node17.invalid":
            return real_getaddrinfo(host, *args, **kwargs)
        lookups.append(host)
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    with pytest.raises(ClusterError, match=r"host name 'node17\.invalid' does not resolve.*set MASTER_ADDR"):
        join_rendezvous("node17.invalid", 20000, is_master=False, rank=1, names=["worker:0", "worker:1"],
                        timeout=30, token="slurm-job1-step0")
    assert lookups == ["node17.invalid"]  # one look-up: failed on the answer, no retries
