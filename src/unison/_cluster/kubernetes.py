"""KubernetesClusterResolver: a cluster from the running pods that match label selectors.

Asks the Kubernetes API (through the ``kubernetes`` client, the optional extra
``pip install 'unison[kubernetes]'``) for the pods of each job's label selectors, every
time the cluster is asked for. It cannot know which pod it runs in, so ``task_type`` and
``task_id`` must be set by the program (as in TensorFlow). It is therefore never chosen
by ``detect_cluster_resolver``: on Kubernetes, a TFJob (Kubeflow's training operator)
sets ``TF_CONFIG`` in each pod, and that is what detection finds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from unison._cluster.base import ClusterResolver, local_accelerators, task_master_url
from unison._cluster.scheduler import LAUNCH, Scheduler
from unison._cluster.spec import ClusterSpec

__all__ = ["KubernetesClusterResolver"]


def _load_client() -> Any:
    try:
        from kubernetes import client, config
    except ImportError as exc:
        raise ImportError(
            "KubernetesClusterResolver needs the Kubernetes Python client: `pip install 'unison[kubernetes]'` "
            "(or `pip install kubernetes`), or pass override_client"
        ) from exc
    try:
        config.load_incluster_config()  # inside a pod: its service account
    except config.ConfigException:
        config.load_kube_config()  # outside: ~/.kube/config
    return client.CoreV1Api()


class KubernetesClusterResolver(ClusterResolver):
    """Resolves the cluster from the running pods that match each job's label selectors.

    Each job's tasks are the pods of its selectors, in selector order and, within a
    selector, sorted by pod name (so the order does not change between calls); a task's
    address is ``pod_ip:tf_server_port``.

    tf.distribute equivalent: ``tf.distribute.cluster_resolver.KubernetesClusterResolver``.
    Differences: the address is the pod's IP (TF used the node's ``host_ip``, which only
    works with host networking and gives two pods of one node the same address), and the
    client is built when first needed, from the in-cluster service account or else
    ``~/.kube/config``.

    Example (on worker 1)::

        resolver = KubernetesClusterResolver({"worker": ["job-name=worker-cluster-a"]})
        resolver.task_type, resolver.task_id = "worker", 1
        strategy = unison.MultiWorkerMirroredStrategy(cluster_resolver=resolver)

    Args:
        job_to_label_mapping: job name -> label selectors (default
            ``{"worker": ["job-name=tensorflow"]}``).
        tf_server_port: the port every task listens on.
        rpc_layer: protocol for master URLs.
        override_client: a ``CoreV1Api``-like object with ``list_pod_for_all_namespaces``;
            with it the ``kubernetes`` package is not needed (credentials are the caller's).

    Raises:
        ImportError: if the ``kubernetes`` package is missing and no client is given.
        ValueError: for a malformed mapping or port.
    """

    def __init__(
        self,
        job_to_label_mapping: Mapping[str, Sequence[str]] | None = None,
        tf_server_port: int = 8470,
        rpc_layer: str | None = "grpc",
        override_client: Any = None,
    ):
        mapping = dict(job_to_label_mapping) if job_to_label_mapping else {"worker": ["job-name=tensorflow"]}
        for job, selectors in mapping.items():
            if isinstance(selectors, str) or not all(isinstance(s, str) for s in selectors):
                raise ValueError(f"job_to_label_mapping[{job!r}] is {selectors!r}, not a list of label selectors; "
                                 f"fix it, e.g. ['job-name=worker']")
        if isinstance(tf_server_port, bool) or not isinstance(tf_server_port, int) or not 1 <= tf_server_port <= 65535:
            raise ValueError(f"tf_server_port {tf_server_port!r} is not a port in 1..65535; fix `tf_server_port`")
        if override_client is None:
            try:
                import kubernetes  # noqa: F401 - fail now, not at the first cluster_spec()
            except ImportError as exc:
                raise ImportError(
                    "KubernetesClusterResolver needs the Kubernetes Python client: "
                    "`pip install 'unison[kubernetes]'` (or `pip install kubernetes`), or pass override_client"
                ) from exc
        self._mapping = {job: list(selectors) for job, selectors in mapping.items()}
        self._port = tf_server_port
        self._client = override_client
        self._task_type: str | None = None
        self._task_id: int | None = None
        self._rpc_layer = rpc_layer

    def cluster_spec(self) -> ClusterSpec:
        """The running pods of each job, asked from the Kubernetes API now.

        Raises:
            RuntimeError: if a matching pod is not in the ``Running`` phase (it names the
                pod and its phase).
        """
        if self._client is None:
            self._client = _load_client()
        cluster: dict[str, list[str]] = {}
        for job, selectors in self._mapping.items():
            addresses = cluster.setdefault(job, [])
            for selector in selectors:
                pods = self._client.list_pod_for_all_namespaces(label_selector=selector).items
                for pod in sorted(pods, key=lambda p: p.metadata.name):
                    if pod.status.phase != "Running":
                        raise RuntimeError(
                            f"pod {pod.metadata.name!r} (job {job!r}, selector {selector!r}) is not running; "
                            f"phase: {pod.status.phase!r}; wait until every pod runs, or fix the selector"
                        )
                    addresses.append(f"{pod.status.pod_ip}:{self._port}")
        return ClusterSpec({job: tasks for job, tasks in cluster.items() if tasks})

    @property
    def task_type(self) -> str | None:
        return self._task_type

    @task_type.setter
    def task_type(self, task_type: str | None) -> None:
        self._task_type = task_type

    @property
    def task_id(self) -> int | None:
        return self._task_id

    @task_id.setter
    def task_id(self, task_id: int | None) -> None:
        self._task_id = task_id

    @property
    def rpc_layer(self) -> str | None:
        return self._rpc_layer

    @rpc_layer.setter
    def rpc_layer(self, rpc_layer: str | None) -> None:
        self._rpc_layer = rpc_layer

    @property
    def environment(self) -> str:
        return ""

    @property
    def scheduler(self) -> Scheduler:
        """unison launch's conventions: Kubernetes runs one task per pod and sets nothing more."""
        return LAUNCH

    def num_accelerators(self, task_type: str | None = None, task_id: int | None = None) -> dict[str, int]:
        """CUDA devices of this pod: every task is asked on its own pod."""
        return local_accelerators()

    def master(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        rpc_layer: str | None = None,
    ) -> str:
        return task_master_url(self, task_type, task_id, rpc_layer)
