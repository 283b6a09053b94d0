"""UnionResolver (TF's merge rules), KubernetesClusterResolver (a fake API client) and
SageMakerClusterResolver (the variables SageMaker sets), and where detection finds them."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest

import unison
from unison import (
    KubernetesClusterResolver,
    SageMakerClusterResolver,
    SimpleClusterResolver,
    SlurmClusterResolver,
    TFConfigClusterResolver,
    TorchrunClusterResolver,
    UnionResolver,
    detect_cluster_resolver,
)
from unison._cluster import merge_clusters
from unison._cluster.resolved import RendezvousKind

# --- UnionResolver ------------------------------------------------------------------------


def test_union_tf_docstring_example_first_resolver_answers():
    workers = SimpleClusterResolver({"worker": ["worker0.example.com:2222", "worker1.example.com:2222"]},
                                    task_type="worker", task_id=0, rpc_layer="grpc")
    ps = SimpleClusterResolver({"ps": ["ps0.example.com:2222", "ps1.example.com:2222"]},
                               task_type="ps", task_id=0, rpc_layer="grpc")
    union = UnionResolver(workers, ps)
    assert union.task_type == "worker" and union.task_id == 0 and union.rpc_layer == "grpc"
    assert union.cluster_spec().as_dict() == {
        "ps": ["ps0.example.com:2222", "ps1.example.com:2222"],
        "worker": ["worker0.example.com:2222", "worker1.example.com:2222"],
    }
    assert union.master("ps", 1) == "grpc://ps1.example.com:2222"


def test_union_overrides_accelerators_by_putting_a_simple_resolver_first(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["a:1", "b:1"]},
                                                "task": {"type": "worker", "index": 1}}))
    tf_config = TFConfigClusterResolver()
    gpu_override = SimpleClusterResolver(tf_config.cluster_spec(), num_accelerators={"GPU": 1})
    union = UnionResolver(gpu_override, tf_config)
    assert union.num_accelerators() == {"GPU": 1}
    # The first resolver answers the task too (here it has none), as in TF.
    assert union.task_type is None
    assert UnionResolver(tf_config, gpu_override).task_type == "worker"


def test_union_lists_of_one_job_concatenate_in_resolver_order():
    first = SimpleClusterResolver({"worker": ["a:1", "b:1"]})
    second = SimpleClusterResolver({"worker": ["c:1"], "ps": ["d:1"]})
    assert UnionResolver(first, second).cluster_spec().as_dict() == {"ps": ["d:1"], "worker": ["a:1", "b:1", "c:1"]}
    assert UnionResolver(second, first).cluster_spec().job_tasks("worker") == ["c:1", "a:1", "b:1"]


def test_union_the_same_sparse_index_twice_is_a_key_error():
    sparse = SimpleClusterResolver({"worker": {0: "a:1"}})
    listed = SimpleClusterResolver({"worker": ["b:1"]})
    with pytest.raises(KeyError, match=r"job 'worker' has task index\(es\) \[0\]"):
        UnionResolver(sparse, listed).cluster_spec()
    with pytest.raises(KeyError):
        UnionResolver(SimpleClusterResolver({"worker": {"0": "a:1"}}), sparse).cluster_spec()


def test_merge_clusters_merges_sparse_jobs_by_index():
    assert merge_clusters([{"worker": {1: "b:1"}}, {"worker": {0: "a:1"}, "ps": ["p:1"]}]) == {
        "worker": {1: "b:1", 0: "a:1"}, "ps": ["p:1"]}
    assert unison.ClusterSpec(merge_clusters([{"worker": {1: "b:1"}}, {"worker": ["a:1"]}])).job_tasks("worker") == [
        "a:1", "b:1"]
    with pytest.raises(KeyError, match=r"\[1\]"):
        merge_clusters([{"worker": {1: "b:1"}}, {"worker": ["a:1", "c:1"]}])


def test_union_overrides_and_setters():
    base = SimpleClusterResolver({"worker": ["a:1", "b:1"]}, task_type="worker", task_id=1, rpc_layer="tcp")
    union = UnionResolver(base, rpc_layer="grpc", task_id=0)
    assert (union.task_type, union.task_id, union.rpc_layer) == ("worker", 0, "grpc")
    union.task_type, union.task_id, union.rpc_layer = "worker", 1, None
    assert (union.task_id, union.rpc_layer) == (1, "tcp")
    assert union.master("worker", 0) == "tcp://a:1"
    resolved = union.resolve(environ={})
    assert (resolved.rank, resolved.leader_address) == (1, "a:1")


def test_union_argument_errors():
    with pytest.raises(ValueError, match="at least one ClusterResolver"):
        UnionResolver()
    with pytest.raises(TypeError, match=r"argument 1 is a dict"):
        UnionResolver(SimpleClusterResolver(), {"worker": ["a:1"]})


# --- Kubernetes ---------------------------------------------------------------------------


def _pod(name: str, ip: str, phase: str = "Running") -> SimpleNamespace:
    return SimpleNamespace(metadata=SimpleNamespace(name=name), status=SimpleNamespace(phase=phase, pod_ip=ip,
                                                                                        host_ip="10.9.9.9"))


class FakeCoreV1Api:
    """``list_pod_for_all_namespaces(label_selector=...)`` over a fixed pod table."""

    def __init__(self, pods_by_selector: dict):
        self.pods_by_selector = pods_by_selector
        self.calls: list[str] = []

    def list_pod_for_all_namespaces(self, *, label_selector: str) -> SimpleNamespace:
        self.calls.append(label_selector)
        return SimpleNamespace(items=list(self.pods_by_selector.get(label_selector, [])))


def test_kubernetes_running_pods_sorted_by_name_per_selector():
    client = FakeCoreV1Api({
        "job-name=worker-a": [_pod("worker-a-2", "10.0.0.12"), _pod("worker-a-0", "10.0.0.10")],
        "job-name=worker-b": [_pod("worker-b-0", "10.0.1.10")],
        "job-name=ps": [_pod("ps-0", "10.0.2.10")],
    })
    resolver = KubernetesClusterResolver({"worker": ["job-name=worker-a", "job-name=worker-b"], "ps": ["job-name=ps"]},
                                         override_client=client)
    assert resolver.cluster_spec().as_dict() == {
        "ps": ["10.0.2.10:8470"], "worker": ["10.0.0.10:8470", "10.0.0.12:8470", "10.0.1.10:8470"]}
    assert resolver.task_type is None and resolver.task_id is None and resolver.master() == ""
    resolver.task_type, resolver.task_id = "worker", 1
    assert resolver.master() == "grpc://10.0.0.12:8470"
    assert resolver.master("ps", 0, rpc_layer="tcp") == "tcp://10.0.2.10:8470"
    resolved = resolver.resolve(environ={})
    assert (resolved.rank, resolved.task_names) == (1, ("worker:0", "worker:1", "worker:2"))


def test_kubernetes_default_mapping_and_port():
    client = FakeCoreV1Api({"job-name=tensorflow": [_pod("tf-1", "10.0.0.2"), _pod("tf-0", "10.0.0.1")]})
    resolver = KubernetesClusterResolver(tf_server_port=2222, rpc_layer=None, override_client=client)
    assert resolver.cluster_spec().job_tasks("worker") == ["10.0.0.1:2222", "10.0.0.2:2222"]
    resolver.cluster_spec()
    assert client.calls == ["job-name=tensorflow", "job-name=tensorflow"]  # asked anew on each call


@pytest.mark.parametrize("phase", ["Pending", "Failed", "Unknown"])
def test_kubernetes_a_pod_not_running_names_it_and_its_phase(phase):
    client = FakeCoreV1Api({"job-name=tensorflow": [_pod("tf-0", "10.0.0.1"), _pod("tf-1", "10.0.0.2", phase)]})
    with pytest.raises(RuntimeError, match=rf"pod 'tf-1' .* is not running; phase: '{phase}'"):
        KubernetesClusterResolver(override_client=client).cluster_spec()


def test_kubernetes_without_the_client_package_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "kubernetes", None)  # import kubernetes -> ImportError
    with pytest.raises(ImportError, match=r"pip install 'unison\[kubernetes\]'"):
        KubernetesClusterResolver()


def test_kubernetes_argument_errors():
    with pytest.raises(ValueError, match=r"job_to_label_mapping\['worker'\] is 'job-name=x'"):
        KubernetesClusterResolver({"worker": "job-name=x"}, override_client=FakeCoreV1Api({}))
    with pytest.raises(ValueError, match=r"tf_server_port 0 is not a port"):
        KubernetesClusterResolver(tf_server_port=0, override_client=FakeCoreV1Api({}))


def test_kubernetes_is_never_detected():
    environ = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    assert isinstance(detect_cluster_resolver(environ=environ), SimpleClusterResolver)


# --- SageMaker ----------------------------------------------------------------------------

SAGEMAKER = {  # as SageMaker's training toolkit sets them in each container
    "SM_HOSTS": '["algo-1","algo-2","algo-3"]',
    "SM_CURRENT_HOST": "algo-2",
    "SM_NUM_GPUS": "0",
    "SM_NETWORK_INTERFACE_NAME": "eth0",
}


def test_sagemaker_hosts_are_sorted_workers_on_port_2223():
    resolver = SageMakerClusterResolver(environ={**SAGEMAKER, "SM_HOSTS": '["algo-3","algo-1","algo-2"]'})
    assert resolver.cluster_spec().as_dict() == {"worker": ["algo-1:2223", "algo-2:2223", "algo-3:2223"]}
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer, resolver.environment) == ("worker", 1, None, "")
    assert resolver.master() == "algo-2:2223"
    assert resolver.master("worker", 0, rpc_layer="grpc") == "grpc://algo-1:2223"
    resolved = resolver.resolve(environ={})
    assert (resolved.rank, resolved.leader_address, resolved.rendezvous) == (1, "algo-1:2223", RendezvousKind.LEADER)


def test_sagemaker_overrides_port_and_task():
    resolver = SageMakerClusterResolver(port=5000, task_id=0, rpc_layer="tcp", environment="google",
                                        environ=SAGEMAKER)
    assert resolver.cluster_spec().job_tasks("worker")[0] == "algo-1:5000"
    assert (resolver.task_id, resolver.master(), resolver.environment) == (0, "tcp://algo-1:5000", "google")


def test_sagemaker_single_host_and_foreign_host():
    single = SageMakerClusterResolver(environ={"SM_HOSTS": '["algo-1"]', "SM_CURRENT_HOST": "algo-1"})
    assert single.cluster_spec().as_dict() == {"worker": ["algo-1:2223"]} and single.master() == ""
    foreign = SageMakerClusterResolver(environ={**SAGEMAKER, "SM_CURRENT_HOST": "algo-9"})
    assert not foreign.cluster_spec() and foreign.task_type is None and foreign.task_id is None
    assert foreign.resolve(environ={}).is_local


@pytest.mark.parametrize("hosts, match", [
    ("algo-1", r"SM_HOSTS='algo-1' is not JSON"),
    ('{"a": 1}', r"is not a JSON list of host names"),
    ('["algo-1", 3]', r"is not a JSON list of host names"),
])
def test_sagemaker_malformed_hosts(hosts, match):
    with pytest.raises(ValueError, match=match):
        SageMakerClusterResolver(environ={**SAGEMAKER, "SM_HOSTS": hosts}).cluster_spec()


def test_sagemaker_missing_variables_and_bad_port():
    with pytest.raises(ValueError, match=r"\['SM_CURRENT_HOST'\] not set"):
        SageMakerClusterResolver(environ={"SM_HOSTS": '["algo-1"]'}).cluster_spec()
    with pytest.raises(ValueError, match=r"port 70000 is not a port"):
        SageMakerClusterResolver(port=70000)


# --- Detection order ----------------------------------------------------------------------

TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
SLURM_STEP = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1",
              "SLURM_STEP_NODELIST": "n1"}


def test_detect_order_tf_config_torchrun_slurm_sagemaker_local():
    tf_config = {"TF_CONFIG": json.dumps({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 0}})}
    assert isinstance(detect_cluster_resolver(environ={**tf_config, **TORCHRUN, **SLURM_STEP, **SAGEMAKER}),
                      TFConfigClusterResolver)
    # torchrun started inside a SageMaker container (SageMaker's torch_distributed) or a SLURM step.
    assert isinstance(detect_cluster_resolver(environ={**TORCHRUN, **SLURM_STEP, **SAGEMAKER}), TorchrunClusterResolver)
    assert isinstance(detect_cluster_resolver(environ={**SLURM_STEP, **SAGEMAKER}), SlurmClusterResolver)
    assert isinstance(detect_cluster_resolver(environ=SAGEMAKER), SageMakerClusterResolver)
    assert detect_cluster_resolver(environ=SAGEMAKER).task_id == 1
    assert isinstance(detect_cluster_resolver("sagemaker", environ=SAGEMAKER), SageMakerClusterResolver)
    with pytest.raises(unison.errors.ClusterError, match=r"'sagemaker' was requested but is not present"):
        detect_cluster_resolver("sagemaker", environ={})


def test_new_resolvers_are_public_with_docstrings():
    for name in ("UnionResolver", "KubernetesClusterResolver", "SageMakerClusterResolver"):
        assert name in unison.__all__ and name in unison._cluster.__all__
        assert getattr(unison, name).__doc__
