"""One resolved cluster: everything a process needs to know about its place, read once.

A :class:`ResolvedCluster` is made from one snapshot of the environment by a resolver's
``resolve()`` (or, for the distribute coordinator, by :func:`resolve_task`), and then
handed down: strategies, process-group formation, the coordinator and the launcher
consume it and never read ``TF_CONFIG``, torchrun's or SLURM's variables, or unison's
own variables themselves. Rank, task names and the collective leader are derived here,
once, by the rules of ``multi_worker_util``; what depends on the scheduler (local rank,
rendezvous token and kind, CPU share, restart advice) is asked of the resolver's
:class:`~unison._cluster.scheduler.Scheduler`, which the resolved cluster carries.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from unison._cluster import env, multi_worker_util
from unison._cluster.scheduler import LAUNCH, RendezvousKind, Scheduler
from unison._cluster.spec import ClusterSpec, split_address

if TYPE_CHECKING:  # pragma: no cover
    from unison._cluster.base import ClusterResolver

__all__ = ["ResolvedCluster", "RendezvousKind", "task_names"]


def task_names(spec: ClusterSpec) -> tuple[str, ...]:
    """Names of the training tasks by rank: the chief first, then the workers in index order."""
    names = [f"chief:{i}" for i in spec.task_indices("chief")] if "chief" in spec.jobs else []
    if "worker" in spec.jobs:
        names += [f"worker:{i}" for i in spec.task_indices("worker")]
    return tuple(names)


def _tasks_on_host(spec: ClusterSpec, task_type: str, task_id: int | None) -> int:
    """How many tasks of the cluster (every job) share this task's host."""
    host = split_address(spec.task_address(task_type, int(task_id or 0)))[0]
    return sum(split_address(address)[0] == host for job in spec.jobs for address in spec.job_tasks(job))


def _parse_name(name: str) -> tuple[str, int]:
    job, index = name.split(":")
    return job, int(index)


@dataclasses.dataclass(frozen=True)
class ResolvedCluster:
    """Where this process sits in its cluster, resolved once.

    Attributes:
        spec: the cluster (empty for local training).
        task_type: this task's job ("chief", "worker", "ps", "evaluator"), or None (a
            client, or local training).
        task_id: this task's index in its job, or None.
        rpc_layer: the protocol of master URLs, or None.
        environment: the environment's name, as the resolver reports it ("torchrun",
            "slurm", TF_CONFIG's ``environment``, "" ...).
        rank: this task's rank among the training tasks (chief 0, then workers), or None
            for a task that does not train with the others.
        task_names: the training tasks' names by rank (``("chief:0", "worker:0", ...)``).
        task_hosts: the host part of each training task's address, by rank: which tasks
            share a machine (the hierarchical all-reduce groups them by it).
        leader_address: ``host:port`` of the collective leader (chief, else worker 0).
        local_rank: this process's index on its host (``LOCAL_RANK`` under torchrun,
            ``SLURM_LOCALID`` under SLURM), or None.
        rendezvous: how the training tasks meet (see :class:`RendezvousKind`): at a store
            opened for them (STORE) if one was given, else where the scheduler says.
        rendezvous_address: the store's ``host:port`` for LEADER and STORE.
        is_chief: whether this task writes checkpoints and summaries.
        restart_count: how many times ``unison launch`` restarted the cluster (0 first).
        rendezvous_token: names this run in the rendezvous store's keys, so a task that
            reaches another run's store (a port clash) is told so instead of joining it
            (``slurm-job<id>-step<id>`` under SLURM; "" elsewhere).
        cpu_share: CPUs this task may use, where the scheduler divides a host between
            tasks without setting threads (SLURM); None elsewhere. The worker group's
            formation lowers torch's intra-op threads to it unless the user chose some.
        scheduler: the conventions of the scheduler that started the process; its
            ``restart_advice()`` ends the message of a lost peer.
    """

    spec: ClusterSpec
    task_type: str | None = None
    task_id: int | None = None
    rpc_layer: str | None = None
    environment: str = ""
    rank: int | None = None
    task_names: tuple[str, ...] = ()
    task_hosts: tuple[str, ...] = ()
    leader_address: str | None = None
    local_rank: int | None = None
    rendezvous: RendezvousKind = RendezvousKind.NONE
    rendezvous_address: str | None = None
    is_chief: bool = True
    restart_count: int = 0
    rendezvous_token: str = ""
    cpu_share: int | None = None
    scheduler: Scheduler = LAUNCH

    @property
    def is_local(self) -> bool:
        """True for local training: no cluster at all."""
        return not self.spec

    @property
    def world_size(self) -> int:
        """Training tasks that form the process group (1 for local training)."""
        return len(self.task_names) or 1

    @property
    def host_placement(self) -> tuple[int, int]:
        """``(index, count)``: this task's index among the training tasks on its host, and
        how many there are (``(0, 1)`` where the hosts are unknown or it does not train).
        Workers sharing a host share its GPUs, one NCCL rank per GPU at most."""
        if self.rank is None or not self.task_hosts:
            return 0, 1
        host = self.task_hosts[self.rank]
        ranks = [r for r, h in enumerate(self.task_hosts) if h == host]
        return ranks.index(self.rank), len(ranks)

    @property
    def task_name(self) -> str:
        """``"type:index"`` of this task (``"local"`` without one)."""
        return f"{self.task_type}:{self.task_id}" if self.task_type is not None else "local"

    @classmethod
    def local(cls) -> ResolvedCluster:
        """The resolved cluster of local training."""
        return cls(ClusterSpec({}))

    @classmethod
    def build(
        cls,
        spec: ClusterSpec,
        task_type: str | None,
        task_id: int | None,
        *,
        rpc_layer: str | None = None,
        environment: str = "",
        scheduler: Scheduler = LAUNCH,
        environ: Mapping[str, str] | None = None,
        rendezvous: str | None = None,
    ) -> ResolvedCluster:
        """Derives rank, names, leader and rendezvous from a validated cluster and task.

        ``environ`` (default ``os.environ``) is read once, here, for the restart count, an
        existing rendezvous store (``UNISON_RENDEZVOUS``) and, through ``scheduler``, the
        local rank, the rendezvous token and the CPU share. ``rendezvous``, the
        ``host:port`` of a store opened for the workers, wins over ``UNISON_RENDEZVOUS``.

        Raises:
            ValueError: if the cluster or task breaks the rules of ``validate_cluster_spec``.
        """
        environ = os.environ if environ is None else environ
        spec = multi_worker_util.validate_cluster_spec(spec, task_type, task_id)
        restart_count = env.restart_count(environ)
        if not spec:
            return cls(spec, task_type, task_id, rpc_layer, environment, restart_count=restart_count,
                       scheduler=scheduler)
        names = task_names(spec)
        trains = task_type in ("chief", "worker")
        chiefs = multi_worker_util.task_count(spec, "chief")
        rank = (0 if task_type == "chief" else chiefs + int(task_id or 0)) if trains else None
        leader_address = spec.task_address(*multi_worker_util.leader_task(spec)) if names else None
        store = rendezvous or env.rendezvous_address(environ)
        if not trains or not names:
            kind, address = RendezvousKind.NONE, None
        elif store:
            kind, address = RendezvousKind.STORE, store
        else:
            kind, address = scheduler.rendezvous_kind(), leader_address
        share = None if task_type is None else scheduler.cpu_share(environ, _tasks_on_host(spec, task_type, task_id))
        hosts = tuple(split_address(spec.task_address(*_parse_name(name)))[0] for name in names)
        return cls(
            spec=spec, task_type=task_type, task_id=task_id, rpc_layer=rpc_layer, environment=environment,
            rank=rank, task_names=names, task_hosts=hosts, leader_address=leader_address,
            local_rank=scheduler.local_rank(environ), rendezvous=kind, rendezvous_address=address,
            is_chief=task_type in ("chief", "evaluator") or (not chiefs and task_type == "worker" and task_id == 0),
            restart_count=restart_count, rendezvous_token=scheduler.rendezvous_token(environ),
            cpu_share=share, scheduler=scheduler,
        )

    @classmethod
    def from_resolver(cls, resolver: ClusterResolver, environ: Mapping[str, str] | None = None, *,
                      rendezvous: str | None = None) -> ResolvedCluster:
        """Reads each of ``resolver``'s answers once and resolves them (``rendezvous`` as in :meth:`build`)."""
        spec = resolver.cluster_spec()
        task_type = resolver.task_type if spec else None
        task_id = resolver.task_id if task_type is not None else None
        if task_type is not None and task_id is None:
            task_id = 0
        return cls.build(spec, task_type, task_id, rpc_layer=resolver.rpc_layer, environment=resolver.environment,
                         scheduler=resolver.scheduler, environ=environ, rendezvous=rendezvous)
