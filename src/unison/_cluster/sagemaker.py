"""SageMakerClusterResolver: a cluster from the variables SageMaker training sets.

SageMaker's training toolkit gives every container ``SM_HOSTS`` (a JSON list of the
job's hosts, e.g. ``["algo-1","algo-2"]``) and ``SM_CURRENT_HOST`` (this one's name).
Every host is a worker, in sorted order, listening on one port (2223, as TensorFlow's).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

from unison._cluster.base import ClusterResolver, local_accelerators, task_master_url
from unison._cluster.scheduler import LAUNCH, Scheduler
from unison._cluster.spec import ClusterSpec

__all__ = ["SageMakerClusterResolver", "SM_HOSTS", "SM_CURRENT_HOST"]

#: JSON list of the training job's hosts.
SM_HOSTS = "SM_HOSTS"
#: This container's host name, one of ``SM_HOSTS``.
SM_CURRENT_HOST = "SM_CURRENT_HOST"


class SageMakerClusterResolver(ClusterResolver):
    """Resolves the cluster from SageMaker's ``SM_HOSTS`` and ``SM_CURRENT_HOST``.

    The cluster is ``{"worker": ["<host>:<port>" for each host, sorted]}`` and this task
    is the worker at ``SM_CURRENT_HOST``'s place; a current host that is not among the
    hosts gives the empty cluster (local training), as in TensorFlow.

    tf.distribute equivalent: ``tf.distribute.cluster_resolver.SageMakerClusterResolver``.
    Differences: malformed variables raise ValueError (TF asserted), and the environment
    can be passed in.

    Example:
        >>> environ = {"SM_HOSTS": '["algo-2", "algo-1"]', "SM_CURRENT_HOST": "algo-2"}
        >>> resolver = SageMakerClusterResolver(environ=environ)
        >>> resolver.cluster_spec().as_dict(), resolver.task_type, resolver.task_id
        ({'worker': ['algo-1:2223', 'algo-2:2223']}, 'worker', 1)

    Args:
        port: the port every host listens on.
        task_type: overrides the task type ("worker").
        task_id: overrides the task index.
        rpc_layer: protocol for master URLs.
        environment: the environment's name.
        environ: the environment to read (default: ``os.environ`` at each call).
    """

    def __init__(
        self,
        port: int = 2223,
        task_type: str | None = None,
        task_id: int | None = None,
        rpc_layer: str | None = None,
        environment: str | None = None,
        *,
        environ: Mapping[str, str] | None = None,
    ):
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise ValueError(f"port {port!r} is not a port in 1..65535; fix `port`")
        self._port = port
        self._task_type = task_type
        self._task_id = task_id
        self._rpc_layer = rpc_layer
        self._environment = environment
        self._environ = environ

    @staticmethod
    def is_present(environ: Mapping[str, str] | None = None) -> bool:
        """Whether ``SM_HOSTS`` and ``SM_CURRENT_HOST`` are set."""
        environ = os.environ if environ is None else environ
        return SM_HOSTS in environ and SM_CURRENT_HOST in environ

    def _hosts(self) -> tuple[list[str], int | None]:
        """(the sorted hosts, this host's index or None)."""
        environ = os.environ if self._environ is None else self._environ
        missing = [name for name in (SM_HOSTS, SM_CURRENT_HOST) if name not in environ]
        if missing:
            raise ValueError(f"SageMaker environment is incomplete: {missing!r} not set; run inside a SageMaker "
                             f"training job, or set them")
        text = environ[SM_HOSTS].strip()
        try:
            hosts = json.loads(text) if text else []
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"{SM_HOSTS}={text!r} is not JSON ({exc.msg}); fix it, e.g. '[\"algo-1\",\"algo-2\"]'"
            ) from exc
        if not isinstance(hosts, list) or not all(isinstance(h, str) and h for h in hosts):
            raise ValueError(f"{SM_HOSTS}={text!r} is not a JSON list of host names; fix it, e.g. '[\"algo-1\"]'")
        hosts = sorted(hosts)
        current = environ[SM_CURRENT_HOST]
        return hosts, hosts.index(current) if current in hosts else None

    def cluster_spec(self) -> ClusterSpec:
        hosts, index = self._hosts()
        if index is None:
            return ClusterSpec({})
        return ClusterSpec({"worker": [f"{host}:{self._port}" for host in hosts]})

    @property
    def task_type(self) -> str | None:
        if self._task_type is not None:
            return self._task_type
        return "worker" if self._hosts()[1] is not None else None

    @task_type.setter
    def task_type(self, task_type: str | None) -> None:
        self._task_type = task_type

    @property
    def task_id(self) -> int | None:
        return self._task_id if self._task_id is not None else self._hosts()[1]

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
        return self._environment or ""

    @property
    def scheduler(self) -> Scheduler:
        """unison launch's conventions: SageMaker runs one task per host and sets nothing more."""
        return LAUNCH

    def num_accelerators(self, task_type: str | None = None, task_id: int | None = None) -> dict[str, int]:
        """CUDA devices of this host: every SageMaker host runs one task."""
        return local_accelerators()

    def master(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        rpc_layer: str | None = None,
    ) -> str:
        """A task's URL; "" for a cluster of one host, as in TensorFlow."""
        spec = self.cluster_spec()
        if sum(spec.num_tasks(job) for job in spec.jobs) <= 1:
            return ""
        return task_master_url(self, task_type, task_id, rpc_layer)
