"""MultiWorkerMirroredStrategy: synchronous replicas across workers (``tf.distribute.MultiWorkerMirroredStrategy``)."""

from __future__ import annotations

import typing
from collections.abc import Sequence
from typing import Any

import torch

from unison._cluster.base import ClusterResolver
from unison._cluster.detect import detect_cluster_resolver
from unison._cluster.resolved import ResolvedCluster
from unison._cluster.simple import SimpleClusterResolver
from unison._collectives.group.process_group import LazyWorkerGroup, choose_backend
from unison._collectives.ops.collective import CollectiveAllReduce
from unison._collectives.ops.local import select_cross_device_ops
from unison._collectives.options import CommunicationOptions
from unison._devices import canonicalize_all, local_devices
from unison._embeddings.tables.table import NoTables
from unison._gradient_sync.bucketed.buckets import BucketedGradientSync
from unison._gradient_sync.replicas.replica_sync import ReplicaGradientSync
from unison._strategies.base import Strategy, StrategyExtended
from unison._strategies.components import GradientSync, StrategyComponents
from unison._strategies.policies import ReplicatedVariablePolicy
from unison._strategies.replicas import replica_runner
from unison._values.variables import DistributedVariable

__all__ = ["MultiWorkerMirroredStrategy", "CollectiveAllReduceStrategy", "collective_components", "default_devices"]


def default_devices(cluster: ResolvedCluster) -> tuple[str, ...]:
    """This worker's devices when none are given: its own share of the host's GPUs.

    One process per GPU is PyTorch's usual layout under torchrun and SLURM (the local
    rank picks it). Elsewhere (TF_CONFIG) a worker alone on its host takes every GPU, as
    TensorFlow's does; workers sharing a host split its GPUs into equal, disjoint shares,
    so that two never drive the same GPU where there are enough of them (fewer GPUs than
    workers: worker i takes GPU i mod count, and the group falls back from NCCL to gloo).
    """
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        return tuple(local_devices())
    if cluster.local_rank is not None:
        return (f"cuda:{cluster.local_rank % gpus}",)
    index, sharing = cluster.host_placement
    share = gpus // sharing
    if share == 0:
        return (f"cuda:{index % gpus}",)
    return tuple(f"cuda:{i}" for i in range(index * share, (index + 1) * share))


@typing.final
class MultiWorkerMirroredStrategy(Strategy):
    """Mirrored replicas on every worker, kept in sync by collective all-reduce.

    With no cluster it is a local strategy over this machine's devices. With one (from
    ``TF_CONFIG``, torchrun or SLURM variables, an explicit resolver, or
    ``configure()`` by the distribute coordinator) the chief and workers form a
    ``torch.distributed`` process group at the collective leader's address.
    ``num_replicas_in_sync`` is local devices x workers; variables start from the
    chief's values (one packed broadcast); with one device per worker gradients are
    all-reduced in buckets from autograd hooks while backward runs.

    Args:
        cluster_resolver: where the cluster comes from; default: detected.
        communication_options: packing, timeout and backend of the collectives.
        devices: this worker's replica devices (a unison extension; default: one GPU per
            process under torchrun/SLURM, else every local GPU, else the CPU).

    Raises:
        ValueError: for a task type other than chief or worker, or bad options.
        ClusterError: if the process group cannot be formed.
    """

    def __init__(self, cluster_resolver: ClusterResolver | None = None,
                 communication_options: CommunicationOptions | None = None, *,
                 devices: Sequence[str | torch.device] | None = None):
        if communication_options is not None and not isinstance(communication_options, CommunicationOptions):
            raise TypeError(
                f"communication_options must be a CommunicationOptions, got {type(communication_options).__name__}"
            )
        self._init_args = (cluster_resolver, communication_options, devices)
        self._resolver = detect_cluster_resolver(cluster_resolver)
        self._options = communication_options or CommunicationOptions()
        cluster = self._resolver.resolve()
        self._devices = canonicalize_all(devices) if devices is not None else default_devices(cluster)
        super().__init__(self._components(cluster))

    def __reduce__(self) -> tuple:
        # Rebuilt from its arguments where it lands (a copy, or a coordinator's server):
        # a detected cluster is detected again there; no connection travels.
        resolver, options, devices = self._init_args
        return _rebuild, (resolver, options, devices)

    @property
    def cluster_resolver(self) -> ClusterResolver:
        """The resolver the cluster came from."""
        return self._resolver

    def configure(self, cluster_spec: Any = None, task_type: str | None = None, task_id: int | None = None,
                  rendezvous: str | None = None) -> None:
        """Joins the given cluster (the distribute coordinator calls this in each worker), meeting
        at the store ``rendezvous`` (``host:port``) where one was opened for the workers."""
        if cluster_spec:
            resolver = SimpleClusterResolver(cluster_spec, task_type=task_type, task_id=int(task_id or 0),
                                             environment=self._resolver.environment)
            self._extended = StrategyExtended(self, self._components(resolver.resolve(rendezvous=rendezvous)))

    def _components(self, cluster: ResolvedCluster) -> StrategyComponents:
        return collective_components(self, cluster, self._devices, self._options)


def collective_components(strategy: Strategy, cluster: ResolvedCluster, devices: tuple[str, ...],
                          options: CommunicationOptions) -> StrategyComponents:
    """MultiWorkerMirrored's parts for ``strategy``: replicas on ``devices``, kept in sync across
    the cluster's chief and workers by collective all-reduce (local replicas alone without a cluster).

    The hybrid strategy (dense layers all-reduced, embedding rows on ps tasks) shares them.
    """
    reduce_op = lambda: strategy.extended.gradient_reduce_op  # noqa: E731 - read at each step
    runner = replica_runner(strategy, devices)
    if cluster.is_local:
        ops = select_cross_device_ops(devices)
        local_sync = ReplicaGradientSync(strategy, devices, ops, reduce_op) if len(devices) > 1 else None
        return StrategyComponents(
            devices=devices, parameter_devices=devices, cross_device_ops=ops,
            variable_policy=ReplicatedVariablePolicy(strategy, devices, gradient_sync=local_sync),
            gradient_sync=local_sync, runner=runner, tables=NoTables(type(strategy).__name__),
            between_graph=True,  # as in TF: each worker runs its own program
        )
    task_type = cluster.task_type
    if task_type not in ("chief", "worker"):
        raise ValueError(
            f"MultiWorkerMirroredStrategy runs on 'chief' and 'worker' tasks, got task_type {task_type!r}; "
            f"ps and evaluator tasks do not train with it (run eval_fn on the evaluator through the "
            f"distribute coordinator); fix `task.type`"
        )
    backend = choose_backend(devices, options, cluster.host_placement[1])  # fails now if it cannot run
    group = LazyWorkerGroup(cluster, devices, options)
    ops = CollectiveAllReduce(devices, group, options, backend=backend, hosts=cluster.task_hosts)
    sync: GradientSync
    if len(devices) == 1:
        sync = BucketedGradientSync(ops.control, ops.transport, options.bytes_per_pack, reduce_op,
                                    ops.all_reduce_sparse)
    else:
        sync = ReplicaGradientSync(strategy, devices, ops, reduce_op, across_workers=True)

    def on_finish(variables: list) -> None:
        primaries = [v.values[0] if isinstance(v, DistributedVariable) else v for v in variables]
        ops.broadcast_from_chief(primaries)
        sync.finalize()

    return StrategyComponents(
        devices=devices, parameter_devices=devices, cross_device_ops=ops,
        variable_policy=ReplicatedVariablePolicy(strategy, devices, gradient_sync=sync, on_finish=on_finish),
        gradient_sync=sync, runner=runner, cluster=cluster, between_graph=True,
        tables=NoTables(type(strategy).__name__),
    )


def _rebuild(resolver: Any, options: Any, devices: Any) -> MultiWorkerMirroredStrategy:
    return MultiWorkerMirroredStrategy(resolver, options, devices=devices)


CollectiveAllReduceStrategy = MultiWorkerMirroredStrategy
