"""Torchrun, SLURM and simple resolvers, SLURM host lists, and environment detection."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from unison import (
    ClusterResolver,
    ClusterSpec,
    SimpleClusterResolver,
    SlurmClusterResolver,
    TFConfigClusterResolver,
    TorchrunClusterResolver,
    detect_cluster_resolver,
)
from unison._cluster import expand_hostlist, expand_tasks_per_node
from unison.errors import ClusterError

TORCHRUN = {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29500"}


# --- torchrun ---------------------------------------------------------------------------


def test_torchrun_resolver():
    resolver = TorchrunClusterResolver(environ=TORCHRUN)
    assert TorchrunClusterResolver.is_present(TORCHRUN)
    assert resolver.cluster_spec() == ClusterSpec({"worker": [f"10.0.0.5:{29500 + i}" for i in range(4)]})
    assert (resolver.task_type, resolver.task_id, resolver.local_rank) == ("worker", 2, 0)
    assert resolver.master(task_id=0) == "tcp://10.0.0.5:29500"  # worker 0 is the rendezvous point
    assert resolver.master() == "tcp://10.0.0.5:29502"
    assert resolver.environment == "torchrun"
    assert resolver.num_accelerators()["GPU"] in (0, 1)


def test_torchrun_ipv6_master():
    resolver = TorchrunClusterResolver(environ={**TORCHRUN, "MASTER_ADDR": "::1", "WORLD_SIZE": "3"})
    assert resolver.cluster_spec().task_address("worker", 0) == "[::1]:29500"


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"RANK": None}, r"\['RANK'\] not set"),
        ({"MASTER_ADDR": None, "LOCAL_RANK": None}, r"\['LOCAL_RANK', 'MASTER_ADDR'\] not set"),
        ({"RANK": "4"}, r"RANK=4 is out of range for WORLD_SIZE=4 \(valid 0..3\); fix `RANK`"),
        ({"RANK": "-1"}, r"RANK='-1' is not an integer >= 0"),
        ({"WORLD_SIZE": "0"}, r"WORLD_SIZE='0' is not an integer >= 1"),
        ({"WORLD_SIZE": "two"}, r"WORLD_SIZE='two'"),
        ({"LOCAL_RANK": "x"}, r"LOCAL_RANK='x'"),
        ({"MASTER_PORT": "0"}, r"MASTER_PORT='0' is not an integer 1..65535"),
        ({"MASTER_PORT": "65534"}, r"MASTER_PORT=65534 leaves no room to name 4 tasks"),
        ({"MASTER_ADDR": "bad host"}, r"'bad host:29500' is not a 'host:port' address"),
    ],
)
def test_torchrun_errors(changes, match):
    environ = {k: v for k, v in {**TORCHRUN, **changes}.items() if v is not None}
    with pytest.raises(ValueError, match=match):
        TorchrunClusterResolver(environ=environ).cluster_spec()


# --- SLURM host lists -------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, hosts",
    [
        ("node1", ["node1"]),
        ("node[001-003,007]", ["node001", "node002", "node003", "node007"]),
        ("node[8-11]", ["node8", "node9", "node10", "node11"]),
        ("node[08-11]", ["node08", "node09", "node10", "node11"]),
        ("a[1-2],b3,c[5]", ["a1", "a2", "b3", "c5"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("gpu-a100-[3,1]", ["gpu-a100-3", "gpu-a100-1"]),
    ],
)
def test_expand_hostlist(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize(
    "text, match",
    [
        ("node[1-3", "unclosed"),
        ("node1-3]", "unbalanced"),
        ("node[[1]]", "nested"),
        ("node[3-1]", "runs backwards"),
        ("node[a-b]", "range 'a-b'"),
        ("node[1,]", "range ''"),
        ("a,,b", "empty or malformed entry ''"),
    ],
)
def test_expand_hostlist_errors(text, match):
    with pytest.raises(ValueError, match=match):
        expand_hostlist(text)


@given(
    prefix=st.from_regex(r"[a-z]{1,5}", fullmatch=True),
    numbers=st.lists(st.integers(0, 999), min_size=1, max_size=20, unique=True),
    width=st.integers(1, 4),
)
def test_compressed_host_list_expands_to_every_host(prefix, numbers, width):
    numbers = sorted(numbers)
    # Compress runs of consecutive numbers into ranges, as SLURM does.
    runs, start = [], numbers[0]
    for previous, current in zip(numbers, numbers[1:] + [None]):
        if current != previous + 1:
            runs.append((start, previous))
            start = current
    body = ",".join(f"{a:0{width}d}" if a == b else f"{a:0{width}d}-{b:0{width}d}" for a, b in runs)
    assert expand_hostlist(f"{prefix}[{body}]") == [f"{prefix}{n:0{width}d}" for n in numbers]


def test_expand_tasks_per_node():
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("4") == [4]
    with pytest.raises(ValueError, match="entry '2x3'"):
        expand_tasks_per_node("2x3")


# --- SLURM resolver ---------------------------------------------------------------------

SLURM = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "3",
    "SLURM_STEP_NUM_TASKS": "5",
    "SLURM_STEP_NODELIST": "node[001-002],gpu7",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2),1",
}


def test_slurm_resolver_block_layout():
    resolver = SlurmClusterResolver(port_base=9000, environ=SLURM)
    assert SlurmClusterResolver.is_present(SLURM)
    expected = ["node001:9000", "node001:9001", "node002:9000", "node002:9001", "gpu7:9000"]
    assert resolver.cluster_spec() == ClusterSpec({"worker": expected})
    assert (resolver.task_type, resolver.task_id) == ("worker", 3)
    assert resolver.master() == "tcp://node002:9001"
    assert resolver.environment == "slurm"


def test_slurm_jobs_are_assigned_to_ranks_in_order():
    resolver = SlurmClusterResolver(jobs={"chief": 1, "worker": 3, "ps": 1}, port_base=8888, environ=SLURM)
    spec = resolver.cluster_spec()
    assert spec.job_tasks("chief") == ["node001:8888"]
    assert spec.job_tasks("worker") == ["node001:8889", "node002:8888", "node002:8889"]
    assert spec.job_tasks("ps") == ["gpu7:8888"]
    assert (resolver.task_type, resolver.task_id) == ("worker", 2)
    last = SlurmClusterResolver(jobs={"chief": 1, "worker": 3, "ps": 1}, environ={**SLURM, "SLURM_PROCID": "4"})
    assert (last.task_type, last.task_id) == ("ps", 0)


def test_slurm_falls_back_to_job_variables_and_even_spread():
    environ = {"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_STEP_ID": "0"}
    resolver = SlurmClusterResolver(port_base=8888, environ=environ)
    assert resolver.cluster_spec().job_tasks("worker") == ["n1:8888", "n1:8889", "n2:8888", "n2:8889"]
    assert resolver.task_id == 1


def test_slurm_accelerators():
    assert SlurmClusterResolver(gpus_per_task=2, environ=SLURM).num_accelerators() == {"GPU": 2}
    # Rank 3 shares node002 with rank 2: 8 GPUs per node -> 4 per task.
    assert SlurmClusterResolver(gpus_per_node=8, environ=SLURM).num_accelerators() == {"GPU": 4}
    assert SlurmClusterResolver(gpus_per_node=8,
                                environ={**SLURM, "SLURM_PROCID": "4"}).num_accelerators() == {"GPU": 8}


@pytest.mark.parametrize(
    "changes, kwargs, match",
    [
        ({"SLURM_PROCID": None}, {}, r"\['SLURM_PROCID'\] not set"),
        ({"SLURM_PROCID": "x"}, {}, r"SLURM_PROCID='x' is not a non-negative integer"),
        ({"SLURM_PROCID": "5"}, {}, r"SLURM_PROCID=5 is out of range for SLURM_NTASKS=5"),
        ({"SLURM_STEP_TASKS_PER_NODE": "2(x3)"}, {}, r"does not add up"),
        ({"SLURM_STEP_TASKS_PER_NODE": None}, {}, r"does not divide over 3 hosts"),
        ({}, {"jobs": {"worker": 2}}, r"jobs \{'worker': 2\} ask for 2 tasks but SLURM runs 5"),
        ({}, {"jobs": {"trainer": 5}}, r"job 'trainer'"),
    ],
)
def test_slurm_errors(changes, kwargs, match):
    environ = {k: v for k, v in {**SLURM, **changes}.items() if v is not None}
    with pytest.raises(ValueError, match=match):
        SlurmClusterResolver(environ=environ, **kwargs).cluster_spec()


def test_slurm_constructor_errors():
    with pytest.raises(ValueError, match="port_base 0"):
        SlurmClusterResolver(port_base=0)
    with pytest.raises(ValueError, match=r"jobs\['worker'\] is 0"):
        SlurmClusterResolver(jobs={"worker": 0})


# --- simple resolver --------------------------------------------------------------------


def test_simple_resolver():
    spec = {"worker": ["a:1", "b:2"]}
    resolver = SimpleClusterResolver(spec, master="tcp://a:1", task_type="worker", task_id=1,
                                     num_accelerators={"GPU": 2}, rpc_layer="tcp")
    assert resolver.cluster_spec() == ClusterSpec(spec)
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == ("worker", 1, "tcp")
    assert resolver.num_accelerators() == {"GPU": 2}
    assert resolver.master("worker", 0) == "tcp://a:1"
    assert resolver.master() == "tcp://a:1"
    assert SimpleClusterResolver(spec, master="b:2", rpc_layer="tcp").master() == "tcp://b:2"
    assert SimpleClusterResolver().cluster_spec() == ClusterSpec({})
    assert SimpleClusterResolver().master() == ""
    with pytest.raises(ValueError, match="task index 2 is out of range"):
        SimpleClusterResolver(spec, task_type="worker", task_id=2)


def test_resolvers_share_the_abstract_contract():
    assert issubclass(SimpleClusterResolver, ClusterResolver)
    with pytest.raises(TypeError, match="Can't instantiate abstract class ClusterResolver"):
        ClusterResolver()


# --- detection --------------------------------------------------------------------------


def test_detect_order_is_tf_config_torchrun_slurm_local():
    tf_config = {"TF_CONFIG": '{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 0}}'}
    everything = {**tf_config, **TORCHRUN, **SLURM}
    assert isinstance(detect_cluster_resolver(environ=everything), TFConfigClusterResolver)
    assert isinstance(detect_cluster_resolver(environ={**TORCHRUN, **SLURM}), TorchrunClusterResolver)
    assert isinstance(detect_cluster_resolver(environ=SLURM), SlurmClusterResolver)
    local = detect_cluster_resolver(environ={})
    assert isinstance(local, SimpleClusterResolver) and not local.cluster_spec()


def test_detect_explicit_resolver_and_names():
    explicit = SimpleClusterResolver({"worker": ["a:1"]}, task_type="worker", task_id=0)
    assert detect_cluster_resolver(explicit, environ=TORCHRUN) is explicit
    resolver = detect_cluster_resolver("slurm", environ={**TORCHRUN, **SLURM})
    assert isinstance(resolver, SlurmClusterResolver) and resolver.task_id == 3
    assert not detect_cluster_resolver("local", environ=TORCHRUN).cluster_spec()


def test_requested_but_absent_environment_raises():
    with pytest.raises(ClusterError, match=r"cluster environment 'torchrun' was requested but is not present "
                                           r"\(RANK, WORLD_SIZE not set\)"):
        detect_cluster_resolver("torchrun", environ=SLURM)
    with pytest.raises(ClusterError, match="'tf_config' was requested"):
        detect_cluster_resolver("tf_config", environ={})
    with pytest.raises(ValueError, match="unknown cluster environment 'kubernetes'"):
        detect_cluster_resolver("kubernetes", environ={})
    with pytest.raises(TypeError, match="resolver must be a ClusterResolver, a name or None, got int: 3"):
        detect_cluster_resolver(3, environ={})
