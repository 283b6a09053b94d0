"""Forming the workers' torch.distributed process group from a resolved cluster.

Where the workers meet is decided once, by the cluster's resolution
(``ResolvedCluster.rendezvous``): at the collective leader's cluster address (the
chief, else worker 0), whose process hosts a TCPStore there; at an existing store (a
launcher or a test harness opened one on port 0); or, under torchrun, at torchrun's own
store (``env://``). This module only follows that decision.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import sys
import threading
from collections.abc import Sequence

import torch
import torch.distributed as dist

from unison._cluster.resolved import RendezvousKind, ResolvedCluster
from unison._cluster.scheduler import LAUNCH
from unison._cluster.spec import split_address
from unison._cluster.threads import THREAD_DEFAULT
from unison._collectives.group.liveness import Liveness
from unison._collectives.group.store_connect import join_rendezvous
from unison._collectives.options import CommunicationImplementation, CommunicationOptions
from unison._devices import is_cuda
from unison.errors import ClusterError, PeerLostError

__all__ = ["WorkerGroup", "LazyWorkerGroup", "form_worker_group", "release_worker_group"]


def choose_backend(devices: Sequence[str], options: CommunicationOptions, workers_on_host: int = 1) -> str:
    """The torch.distributed backend for ``options.implementation`` on ``devices``.

    NCCL takes one rank per GPU: where more of the group's workers share this host than
    it has GPUs, AUTO chooses gloo (which stages CUDA tensors through the host) and an
    explicit NCCL is refused, naming the fix.
    """
    on_cuda = all(is_cuda(d) for d in devices)
    implementation = options.implementation
    gpus_enough = not on_cuda or workers_on_host <= torch.cuda.device_count()
    if implementation is CommunicationImplementation.NCCL:
        if not on_cuda or not dist.is_nccl_available():
            raise ValueError(
                f"CommunicationImplementation.NCCL needs CUDA replica devices and NCCL, got devices "
                f"{list(devices)!r} (NCCL available: {dist.is_nccl_available()}); use RING or AUTO"
            )
        if not gpus_enough:
            raise ValueError(
                f"CommunicationImplementation.NCCL needs one GPU per worker, but {workers_on_host} workers share "
                f"this host and it has {torch.cuda.device_count()} GPU(s); run at most "
                f"{torch.cuda.device_count()} workers per host, or use RING or AUTO (gloo)"
            )
        return "nccl"
    if implementation is CommunicationImplementation.AUTO and on_cuda and dist.is_nccl_available() and gpus_enough:
        return "nccl"
    return "gloo"


@dataclasses.dataclass
class WorkerGroup:
    """The workers' process group and what is needed to explain its failures."""

    group: dist.ProcessGroup | None  # None: the default group
    store: dist.Store | None
    rank: int
    world_size: int
    names: list[str]
    backend: str
    timeout: float
    liveness: Liveness | None
    #: How the scheduler in use restarts a cluster that lost a task (``ResolvedCluster.scheduler``).
    restart_advice: str = LAUNCH.restart_advice()
    #: Groups of some of these workers made from this one (a host's workers, a column across
    #: hosts), released with it at exit (:func:`release_worker_group`).
    subgroups: list[WorkerGroup] = dataclasses.field(default_factory=list)

    def lost_peer_error(self, operation: str, cause: BaseException) -> PeerLostError:
        """A PeerLostError for a failed collective, naming the tasks that stopped and how
        the scheduler in use restarts them."""
        missing = self.liveness.missing() if self.liveness is not None else []
        if missing:
            who = f"{', '.join(missing)}; a peer crashed, was killed or did not answer"
        elif self.liveness is not None:  # alive, yet absent: stuck, or in another collective
            who = ("none, every heartbeat is alive: a peer is stuck, or the workers called different "
                   "collectives (one stepped, built a model or unfroze a parameter the others did not), "
                   "and it did not answer")
        else:
            who = "unknown; a peer crashed, was killed or did not answer"
        return PeerLostError(
            f"{operation} over the {self.backend} group of {self.world_size} workers failed on "
            f"{self.names[self.rank]}: missing task(s): {who} within timeout_seconds={self.timeout:g}. "
            f"{self.restart_advice} Cause: {cause}"
        )


def _connect_store(cluster: ResolvedCluster, timeout: datetime.timedelta) -> dist.Store:
    address = cluster.rendezvous_address or ""
    names = list(cluster.task_names)
    rank = cluster.rank or 0
    if cluster.rendezvous is RendezvousKind.STORE:
        host, port = split_address(address, field="rendezvous store address")
        return join_rendezvous(host, port, is_master=False, rank=rank, names=names, timeout=timeout)
    host, port = split_address(address, field="collective leader address")
    return join_rendezvous(host, port, is_master=rank == 0, rank=rank, names=names, timeout=timeout,
                           token=cluster.rendezvous_token)


def store_prefix(cluster: ResolvedCluster) -> str:
    """The prefix of the group's keys: ``unison``, plus the run's token where it has one."""
    return f"unison/{cluster.rendezvous_token}" if cluster.rendezvous_token else "unison"


def _check_trains(cluster: ResolvedCluster) -> int:
    if cluster.rank is None or cluster.rendezvous is RendezvousKind.NONE:
        raise ValueError(
            f"task {cluster.task_name} does not train with the cluster's workers (training tasks: "
            f"{list(cluster.task_names)!r}), so it cannot join their process group; run it as a 'chief' or "
            f"'worker' task"
        )
    return cluster.rank


def form_worker_group(cluster: ResolvedCluster, devices: Sequence[str], options: CommunicationOptions) -> WorkerGroup:
    """Joins (or reuses) the process group of the cluster's chief and workers.

    Raises:
        ValueError: if this task is not a training task (ps, evaluator, client).
        ClusterError: if the rendezvous or the group cannot be formed in time.
    """
    rank = _check_trains(cluster)
    names = list(cluster.task_names)
    world_size = len(names)
    backend = choose_backend(devices, options, cluster.host_placement[1])
    seconds = options.effective_timeout
    timeout = datetime.timedelta(seconds=seconds)
    if dist.is_initialized():
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise ClusterError(
                f"a torch.distributed group is already initialised with rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, but the cluster places this task ({names[rank]}) at rank {rank} of "
                f"{world_size}; destroy it first or let unison form it"
            )
        return WorkerGroup(dist.group.WORLD, None, rank, world_size, names, dist.get_backend(), seconds, None,
                           cluster.scheduler.restart_advice())
    THREAD_DEFAULT.apply(cluster.cpu_share, names[rank])  # once per process, before any work
    try:
        if cluster.rendezvous is RendezvousKind.TORCHRUN:
            dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size, timeout=timeout)
            store = None
        else:
            store = dist.PrefixStore(store_prefix(cluster), _connect_store(cluster, timeout))
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - re-raised with the cluster's words
        raise ClusterError(
            f"{names[rank]} could not join the {backend} process group of {world_size} workers within "
            f"{seconds:g} s at the collective leader {names[0]}: {exc}; check that every task of the "
            f"cluster is running and that the addresses in the cluster spec are reachable"
        ) from exc
    liveness = Liveness(store, rank, names) if store is not None else None
    formed = WorkerGroup(dist.group.WORLD, store, rank, world_size, names, backend, seconds, liveness,
                         cluster.scheduler.restart_advice())
    atexit.register(release_worker_group, formed)
    return formed


def release_worker_group(group: WorkerGroup, timeout: float = 10.0) -> None:
    """Stops the heartbeat, destroys the process group unison formed and drops unison's handles to it.

    Registered with ``atexit`` so it runs before the interpreter finalises. gloo's
    worker threads drop their last reference to a finished collective (and so to its
    tensors) after the caller's ``wait()`` returned; one that does so while Python is
    finalising cannot take the GIL and aborts the process ("terminate called without an
    active exception"). Those threads end only when nothing references the
    ProcessGroup object any more -- ``destroy_process_group`` alone leaves them running
    while a handle to it is held -- so the handles unison holds, ``group.group`` and its
    subgroups', are dropped here too, whoever destroyed the group: a script that ends
    with its own ``dist.destroy_process_group()`` used to leave them held, and such exits
    sometimes aborted (``benchmarks/RESULTS.md``, 'an exit abort on the gloo fallback').
    (A DDP module of the user's still holding the group keeps the threads alive.)
    The release runs in a helper thread joined for at most ``timeout`` seconds, so an
    exit after an error, with a collective still waiting for a peer that is gone, is not
    held up.
    """
    if group.liveness is not None:
        group.liveness.stop()
    held = [handle for handle in (group, *group.subgroups) if handle.group is not None]
    if not held:
        return  # released already (an earlier call)
    ours = dist.is_initialized() and dist.group.WORLD is group.group  # not destroyed (or replaced) by the user

    def release() -> None:
        if ours:
            dist.destroy_process_group()
        for handle in held:
            handle.group = None  # the last references: their destructors join gloo's threads, here

    releaser = threading.Thread(target=release, name="unison-destroy-group", daemon=True)
    releaser.start()
    releaser.join(timeout)
    if releaser.is_alive():
        print(f"unison: {group.names[group.rank]} exits without destroying its process group: a collective "
              f"still waits for a peer after {timeout:g} s", file=sys.stderr, flush=True)


class LazyWorkerGroup:
    """Forms the worker group on first use, so strategies can be built, copied and
    shipped (the distribute coordinator does) before any connection is made."""

    def __init__(self, cluster: ResolvedCluster, devices: Sequence[str], options: CommunicationOptions):
        self._args = (cluster, tuple(devices), options)
        self.rank = _check_trains(cluster)
        self.names = list(cluster.task_names)
        self.world_size = len(self.names)
        self._group: WorkerGroup | None = None
        self._lock = threading.Lock()

    def get(self) -> WorkerGroup:
        """The formed group (formed now if needed)."""
        if self._group is None:
            with self._lock:
                if self._group is None:
                    self._group = form_worker_group(*self._args)
        return self._group
