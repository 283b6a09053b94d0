"""ClusterSpec: construction, queries, equality, and the errors of malformed clusters."""

import copy
import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from unison import ClusterSpec
from unison._cluster import split_address


def test_list_and_dict_forms_are_equal():
    from_lists = ClusterSpec({"worker": ["a:1", "b:2"], "ps": ["c:3"]})
    from_dicts = ClusterSpec({"worker": {1: "b:2", 0: "a:1"}, "ps": {"0": "c:3"}})
    assert from_lists == from_dicts
    assert hash(from_lists) == hash(from_dicts)
    assert from_lists.as_dict() == {"ps": ["c:3"], "worker": ["a:1", "b:2"]}


def test_queries():
    spec = ClusterSpec({"worker": ["a:1", "b:2"], "chief": ["c:3"]})
    assert spec.jobs == ["chief", "worker"]
    assert spec.num_tasks("worker") == 2
    assert spec.job_tasks("worker") == ["a:1", "b:2"]
    assert spec.task_indices("worker") == [0, 1]
    assert spec.task_address("worker", 1) == "b:2"
    assert spec.task_address("chief", 0) == "c:3"
    assert bool(spec) and not ClusterSpec({}) and not ClusterSpec(None)


def test_copy_of_spec_and_independence_from_input():
    source = {"worker": ["a:1"]}
    spec = ClusterSpec(source)
    source["worker"].append("b:2")
    assert spec.num_tasks("worker") == 1
    assert ClusterSpec(spec) == spec
    assert copy.deepcopy(spec) == spec
    assert pickle.loads(pickle.dumps(spec)) == spec
    returned = spec.as_dict()
    returned["worker"].append("z:9")
    assert spec.job_tasks("worker") == ["a:1"]


def test_inequality():
    assert ClusterSpec({"worker": ["a:1"]}) != ClusterSpec({"worker": ["a:2"]})
    assert ClusterSpec({"worker": ["a:1"]}) != {"worker": ["a:1"]}


def test_unknown_job_and_index_out_of_range():
    spec = ClusterSpec({"worker": ["a:1", "b:2"]})
    with pytest.raises(ValueError, match=r"no job 'ps' in the cluster; its jobs are \['worker'\]"):
        spec.num_tasks("ps")
    with pytest.raises(ValueError, match=r"task index 2 is out of range: cluster has 2 'worker' tasks \(valid 0..1\)"):
        spec.task_address("worker", 2)
    with pytest.raises(ValueError, match="task index -1 is out of range"):
        spec.task_address("worker", -1)


@pytest.mark.parametrize(
    "cluster, match",
    [
        ({"worker": []}, r"cluster job 'worker' is empty \(\[\]\).*`cluster.worker`"),
        ({"worker": "a:1"}, r"cluster job 'worker' is 'a:1', not a list"),
        ({"worker": ["localhost"]}, r"cluster.worker\[0\] 'localhost' is not a 'host:port' address"),
        ({"worker": ["a:1", "b:http"]}, r"cluster.worker\[1\] 'b:http' has port 'http'"),
        ({"worker": ["a:0"]}, r"has port '0', which is not an integer in 1..65535"),
        ({"worker": ["a:70000"]}, r"has port '70000'"),
        ({"worker": [":2222"]}, r"':2222' is not a 'host:port' address"),
        ({"worker": [2222]}, r"cluster.worker\[0\] 2222 is a int, not a 'host:port' string"),
        ({"worker": {0: "a:1", 2: "b:2"}}, r"task indices \[0, 2\], missing \[1\]"),
        ({"worker": {"x": "a:1"}}, r"task index 'x', which is not a non-negative integer"),
        ({"worker": {-1: "a:1"}}, r"task index -1, which is not a non-negative integer"),
        ({"worker": ["a:1"], "ps": ["a:1"]},
         r"address 'a:1' is given to both `cluster.ps\[0\]` and `cluster.worker\[0\]`"),
        ({"bad job": ["a:1"]}, r"job name 'bad job'"),
    ],
)
def test_malformed_clusters_name_the_field(cluster, match):
    with pytest.raises(ValueError, match=match):
        ClusterSpec(cluster)


@pytest.mark.parametrize(
    "cluster, first, second",
    [
        ({"worker": ["127.0.0.1:2222", "localhost:2222"]}, "cluster.worker[0]", "cluster.worker[1]"),
        ({"worker": ["LOCALHOST:2222", "[::1]:2222"]}, "cluster.worker[0]", "cluster.worker[1]"),
        ({"chief": ["127.0.0.1:2222"], "worker": ["[::ffff:127.0.0.1]:2222"]}, "cluster.chief[0]", "cluster.worker[0]"),
        ({"ps": ["127.0.1.1:7000"], "worker": ["localhost:2222", "127.0.0.1:7000"]},
         "cluster.ps[0]", "cluster.worker[1]"),
        ({"worker": ["Node-1:2222", "node-1:2222"]}, "cluster.worker[0]", "cluster.worker[1]"),
        ({"worker": ["[2001:db8::1]:2222", "[2001:db8:0::1]:2222"]}, "cluster.worker[0]", "cluster.worker[1]"),
    ],
)
def test_one_endpoint_spelled_two_ways_is_refused_naming_both_tasks(cluster, first, second):
    """127.0.0.1:P and localhost:P used to be accepted, and worker:1 "never arrived" after the timeout."""
    with pytest.raises(ValueError) as info:
        ClusterSpec(cluster)
    message = str(info.value)
    for fragment in (f"`{first}`", f"`{second}`", "are one endpoint", "give one of them another port"):
        assert fragment in message, message
    first_task, second_task = (f.removeprefix("cluster.").replace("[", ":").rstrip("]") for f in (first, second))
    assert f"tasks {first_task} and {second_task}" in message, message


def test_this_machines_name_is_loopback_when_it_resolves_to_loopback(monkeypatch):
    from unison._cluster import spec as spec_module

    monkeypatch.setattr(spec_module.socket, "gethostname", lambda: "trainbox")
    monkeypatch.setattr(spec_module, "_resolves_to_loopback", lambda name: name == "trainbox")
    with pytest.raises(ValueError, match=r"'trainbox:2222' of `cluster.worker\[0\]` and '127.0.0.1:2222'"):
        ClusterSpec({"worker": ["trainbox:2222", "127.0.0.1:2222"]})
    # Another machine's name is never looked up nor taken for this one.
    assert ClusterSpec({"worker": ["otherbox:2222", "127.0.0.1:2222"]})


@pytest.mark.parametrize(
    "cluster",
    [
        {"worker": ["localhost:2222", "127.0.0.1:2223", "[::1]:2224"]},  # one host, different ports
        {"chief": ["localhost:2222"], "worker": ["localhost:2223"], "ps": ["127.0.0.1:2224"],
         "evaluator": ["127.0.0.1:2225"]},
        {"worker": ["10.0.0.1:2222", "10.0.0.2:2222", "node-1:2222", "node-2:2222"]},  # one port, different hosts
        {"worker": ["10.0.0.1:2222", "[::ffff:10.0.0.2]:2222"]},
    ],
)
def test_tasks_sharing_a_host_on_different_ports_or_a_port_on_different_hosts_are_accepted(cluster):
    assert ClusterSpec(cluster).as_dict() == cluster


def test_not_a_mapping_is_a_type_error():
    with pytest.raises(TypeError, match="cluster must be a dict"):
        ClusterSpec(["a:1"])


@pytest.mark.parametrize(
    "address, expected",
    [("127.0.0.1:2222", ("127.0.0.1", 2222)), ("node-1.svc:1", ("node-1.svc", 1)), ("[::1]:65535", ("::1", 65535))],
)
def test_split_address(address, expected):
    assert split_address(address) == expected


_hosts = st.from_regex(r"[a-z][a-z0-9-]{0,10}[a-z0-9]", fullmatch=True)
_addresses = st.builds(lambda h, p: f"{h}:{p}", _hosts, st.integers(1, 65535))
_clusters = st.dictionaries(
    st.sampled_from(["chief", "worker", "ps", "evaluator", "trainer"]),
    st.lists(_addresses, min_size=1, max_size=4),
    max_size=4,
).filter(lambda c: len({a for tasks in c.values() for a in tasks}) == sum(len(t) for t in c.values()))


@given(_clusters)
def test_round_trip_through_as_dict_and_dict_form(cluster):
    spec = ClusterSpec(cluster)
    assert ClusterSpec(spec.as_dict()) == spec
    indexed = {job: {str(i): a for i, a in enumerate(tasks)} for job, tasks in cluster.items()}
    assert ClusterSpec(indexed) == spec
    for job, tasks in cluster.items():
        assert [spec.task_address(job, i) for i in range(len(tasks))] == tasks
