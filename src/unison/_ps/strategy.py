"""ParameterServerStrategy: variables on ps tasks, functions scheduled onto workers.

The chief runs the program (the coordinator). Parameters created in ``scope()`` live on
the ps tasks (see :mod:`unison._ps.remote_variables.variable_policy`); a ``unison.ClusterCoordinator`` sends
functions to whichever worker is free; workers pull parameters and push gradients, and
the ps tasks apply the optimizer asynchronously, atomically per shard.
``strategy.extended.variable_placement(v)`` says where a variable lives.

tf.distribute equivalent: ``tf.distribute.ParameterServerStrategy`` (TF2, with a
``ClusterCoordinator``). Differences: ``timeout_seconds`` bounds how long a lost ps task
goes unnoticed; ``variable_placer`` may replace round-robin placement.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from unison._cluster.multi_worker_util import TASK_TYPES
from unison._cluster.resolved import ResolvedCluster
from unison._collectives.ops.local import ReductionToOneDevice
from unison._coordinator.channel import require_authkey
from unison._ps.remote_variables.optimizer_state import install_optimizer_state_on_ps
from unison._ps.remote_variables.variable_policy import PSVariablePolicy
from unison._ps.remote_variables.variable_specs import task_device
from unison._ps.worker.remote_table import RemoteTables
from unison._strategies.base import Strategy
from unison._strategies.components import StrategyComponents
from unison._strategies.replicas import InlineReplicaRunner

__all__ = ["ParameterServerStrategy"]


@dataclasses.dataclass(frozen=True)
class PSClusterInfo:
    """The parameter-server cluster as the coordinator sees it."""

    ps: tuple[str, ...]
    workers: tuple[str, ...]
    timeout: float
    authkey_source: bytes | None

    @property
    def authkey(self) -> bytes:
        return require_authkey(self.authkey_source)


def _cluster_info(resolver: Any, timeout: float, authkey: bytes | None) -> PSClusterInfo:
    spec = resolver.cluster_spec()  # read once more below through resolve(), after these checks
    jobs = spec.as_dict()
    if not jobs or not any(jobs.values()):
        raise ValueError("Cluster spec must be non-empty; pass a resolver whose cluster has 'ps' and 'worker' jobs "
                         "(e.g. TF_CONFIG's `cluster`)")
    for job in jobs:
        if job not in TASK_TYPES:
            raise ValueError(f"cluster has job {job!r}, which is not a task type of a parameter-server cluster "
                             f"{TASK_TYPES!r}; rename or remove it")
    if not jobs.get("ps"):
        raise ValueError(f"There must be at least one ps: the cluster {jobs!r} has none; add a 'ps' job")
    if not jobs.get("worker"):
        raise ValueError(f"There must be at least one worker: the cluster {jobs!r} has none; add a 'worker' job")
    task_type = getattr(resolver, "task_type", None)
    if task_type not in (None, "chief"):
        raise ValueError(f"ParameterServerStrategy runs on the coordinator (the 'chief' task), not on task type "
                         f"{task_type!r}; run `unison.Server(resolver).join()` on workers and ps tasks")
    return PSClusterInfo(tuple(jobs["ps"]), tuple(jobs["worker"]), timeout, authkey)


@typing.final
class ParameterServerStrategy(Strategy):
    """Asynchronous parameter-server training (``tf.distribute.ParameterServerStrategy``).

    Create it on the coordinator (the chief); workers and ps tasks run
    ``unison.Server(resolver).join()``. Nothing connects until variables are created
    or a ``ClusterCoordinator`` is made.

    Args:
        cluster_resolver: the cluster (default: ``TFConfigClusterResolver()``).
        variable_partitioner: ``partitioner(shape, dtype)`` deciding shards along axis 0
            (see ``unison.partitioners``); None keeps every variable whole.
        timeout_seconds: how long a ps task may fail to answer before the error.
        variable_placer: ``None``/``"round_robin"`` (TensorFlow's rule), ``"least_loaded"``
            (tensorpack's), or a callable from element count to ps task index.
        authkey: the cluster's key (default: ``UNISON_AUTHKEY``/``UNISON_AUTHKEY_FILE``).

    Raises:
        ValueError: "Cluster spec must be non-empty", "There must be at least one ps",
            "There must be at least one worker", or a bad task type.
    """

    def __init__(self, cluster_resolver: Any = None, variable_partitioner: Any = None,
                 timeout_seconds: float = 30.0, variable_placer: Any = None, authkey: bytes | None = None):
        if cluster_resolver is None:
            from unison._cluster import TFConfigClusterResolver

            cluster_resolver = TFConfigClusterResolver()
        if isinstance(timeout_seconds, bool) or not isinstance(timeout_seconds, (int, float)) or timeout_seconds <= 0:
            raise ValueError(f"timeout_seconds must be a positive number, got {timeout_seconds!r}")
        install_optimizer_state_on_ps()
        self._init_args = (cluster_resolver, variable_partitioner, timeout_seconds, variable_placer, authkey)
        self._ps_info = _cluster_info(cluster_resolver, float(timeout_seconds), authkey)
        self._cluster_resolver = cluster_resolver
        policy = self._policy = PSVariablePolicy(list(self._ps_info.ps), lambda: self._ps_info.authkey,
                                                 float(timeout_seconds), variable_partitioner, variable_placer)
        resolved = cluster_resolver.resolve()
        # The coordinator runs one replica itself and forms no group: the workers run the
        # scheduled functions, each on its own.
        coordinator = ResolvedCluster(resolved.spec, resolved.task_type, resolved.task_id, resolved.rpc_layer,
                                      resolved.environment, is_chief=True, restart_count=resolved.restart_count,
                                      scheduler=resolved.scheduler)
        super().__init__(StrategyComponents(
            devices=("cpu:0",), parameter_devices=tuple(task_device(i) for i in range(len(self._ps_info.ps))),
            cross_device_ops=ReductionToOneDevice(), variable_policy=policy,
            runner=InlineReplicaRunner(self, ("cpu:0",)), cluster=coordinator,
            tables=RemoteTables(len(self._ps_info.ps), lambda: policy.client),
        ))

    @property
    def ps_cluster(self) -> PSClusterInfo:
        """The ps and worker addresses, the timeout and the key the coordinator connects with."""
        return self._ps_info

    @property
    def cluster_resolver(self) -> Any:
        """The resolver the strategy was made with."""
        return self._cluster_resolver

    def __repr__(self) -> str:
        return f"ParameterServerStrategy(workers={len(self._ps_info.workers)}, ps={len(self._ps_info.ps)})"
