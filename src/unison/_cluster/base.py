"""The cluster-resolver contract: how a process learns its cluster and its place in it.

Each scheduler describes a cluster its own way (``TF_CONFIG``, torchrun variables,
SLURM variables, or an explicit spec). A resolver turns one of them into the same
answers: the ClusterSpec, this task's type and index, the RPC layer, the number of
accelerators of a task, the master address of a task, and the scheduler whose
conventions the process follows (``cluster.scheduler``). Strategies take a resolver;
``cluster.detect`` picks one.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping

from unison import _devices as devices
from unison._cluster.resolved import ResolvedCluster
from unison._cluster.scheduler import Scheduler
from unison._cluster.spec import ClusterSpec

__all__ = ["ClusterResolver", "format_master_url", "task_master_url", "local_accelerators"]


def format_master_url(address: str, rpc_layer: str | None = None) -> str:
    """``"rpc_layer://address"``, or the bare address when there is no RPC layer.

    unison's default layer is ``"tcp"``, which makes a master URL a valid
    ``torch.distributed`` ``init_method``.
    """
    return f"{rpc_layer}://{address}" if rpc_layer else address


def local_accelerators() -> dict[str, int]:
    """This machine's CUDA devices, under TF's key ``"GPU"``: what a task sees on its own host."""
    return {"GPU": sum(devices.is_cuda(d) for d in devices.local_devices())}


def task_master_url(resolver: ClusterResolver, task_type: str | None, task_id: int | None,
                    rpc_layer: str | None) -> str:
    """The master URL of a task of ``resolver``'s cluster, by default its own task.

    The shared body of the resolvers' ``master()``: "" when no task is known.
    """
    task_type = task_type if task_type is not None else resolver.task_type
    task_id = task_id if task_id is not None else resolver.task_id
    if task_type is None or task_id is None:
        return ""
    address = resolver.cluster_spec().task_address(task_type, task_id)
    return format_master_url(address, rpc_layer or resolver.rpc_layer)


class ClusterResolver(abc.ABC):
    """Abstract source of a cluster description.

    Subclasses are final; each implements every abstract member below and nothing else.

    tf.distribute equivalent: ``tf.distribute.cluster_resolver.ClusterResolver``.
    Difference: ``num_accelerators`` counts CUDA devices, reported under TF's key
    ``"GPU"`` so code written for TensorFlow reads it unchanged.
    """

    def resolve(self, environ: Mapping[str, str] | None = None, *,
                rendezvous: str | None = None) -> ResolvedCluster:
        """This process's place in the cluster, resolved once into a frozen value.

        Strategies, group formation and the coordinator take this value instead of
        asking the resolver (and the environment) again. ``environ`` (default
        ``os.environ``) supplies the local rank, an existing rendezvous store and the
        restart count. ``rendezvous`` is the ``host:port`` of a store someone opened for
        the workers (the distribute coordinator's standalone client does); it wins over
        ``UNISON_RENDEZVOUS``.

        Raises:
            ValueError: if the environment describes an invalid cluster.
        """
        return ResolvedCluster.from_resolver(self, environ, rendezvous=rendezvous)

    @abc.abstractmethod
    def cluster_spec(self) -> ClusterSpec:
        """The current cluster; empty for local training.

        Raises:
            ValueError: if the environment describes an invalid cluster.
        """

    @property
    @abc.abstractmethod
    def task_type(self) -> str | None:
        """This task's job name ("chief", "worker", "ps", "evaluator"), or None."""

    @property
    @abc.abstractmethod
    def task_id(self) -> int | None:
        """This task's index within its job, or None."""

    @property
    @abc.abstractmethod
    def rpc_layer(self) -> str | None:
        """The protocol prefixed to master URLs (e.g. ``"tcp"``), or None for bare addresses."""

    @property
    @abc.abstractmethod
    def environment(self) -> str:
        """The scheduler's name for the environment ("" when unknown)."""

    @property
    @abc.abstractmethod
    def scheduler(self) -> Scheduler:
        """The conventions of the scheduler that started this process (local rank,
        rendezvous, CPU share, restart advice); ``LAUNCH`` where there are none of its own."""

    @abc.abstractmethod
    def num_accelerators(self, task_type: str | None = None, task_id: int | None = None) -> dict[str, int]:
        """Accelerators available to one task, e.g. ``{"GPU": 2}`` (``{"GPU": 0}`` on CPU)."""

    @abc.abstractmethod
    def master(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        rpc_layer: str | None = None,
    ) -> str:
        """The URL of a task (by default this one), prefixed by the RPC layer.

        Returns "" when no task is known (local training or a client).

        Raises:
            ValueError: if the named task is not in the cluster.
        """
