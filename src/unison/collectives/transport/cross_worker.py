"""Cross-worker transports: how a batch of dense tensors is summed across workers.

Chosen once, when the cross-device ops are built (``choose_transport``), and passed in,
so a reduction reads straight through:

- ``PackedTransport``: packed ``all_reduce`` collectives over the group (gloo or NCCL),
  in reverse order, about ``bytes_per_pack`` bytes per pack;
- ``SharedMemoryTransport``: when every worker may be on this host (gloo,
  ``implementation=AUTO``): each worker writes its tensors into one ``/dev/shm`` file
  and sums a slice of everyone's. If the workers find they cannot share memory
  (another host, no space), all of them fall back to the packed transport for good.
- ``HierarchicalTransport``: when the workers span several hosts and some share one
  (gloo, AUTO): each host's workers sum their tensors in shared memory, each worker
  summing one slice; when every host has as many workers, each worker then all-reduces
  its slice with the workers of the same local rank on the other hosts (every worker
  carries a share of the network traffic, and no one waits for its host first), else
  one leader per host all-reduces the whole host sum; the host's workers copy the total
  out of the shared file (Horovod's hierarchical all-reduce: a local reduce-scatter, a
  cross-host all-reduce per slice, a local all-gather; TF's hierarchical copy, for
  processes). It falls back to the packed transport, on every host together, when a
  host cannot give the memory.

All take the per-call check as an argument and run it before any data moves. Each
names the way gradient buckets travel with it (``bucket_transport``, one of
``bucket_transports.py``): over the group, compressed, through PowerSGD, or in the shared
files, where a full bucket only announces itself and the transport completes the sums.
"""

from __future__ import annotations

import abc
import datetime
import typing
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from unison.collectives.group.process_group import WorkerGroup
from unison.collectives.group.worker_control import WorkerControl
from unison.collectives.options import CommunicationImplementation, CommunicationOptions, Compression, PowerSGD
from unison.collectives.transport.bucket_transports import (
    AllReduceBuckets,
    BucketTransport,
    CompressedBuckets,
    PowerSGDBuckets,
)
from unison.collectives.transport.compression import Compressor
from unison.collectives.transport.packed_all_reduce import PackedAllReduce
from unison.collectives.transport.powersgd import PowerSGDReducer
from unison.collectives.transport.shared_buckets import ONE_SHOT_BYTES, PipelinedHostBuckets, SharedMemoryBuckets
from unison.collectives.transport.shared_memory import SharedMemoryAllReduce, SharedSegment
from unison.collectives.transport.shm_signals import WRITTEN

__all__ = [
    "CrossWorkerTransport",
    "PackedTransport",
    "SharedMemoryTransport",
    "HierarchicalTransport",
    "CompressedTransport",
    "PowerSGDTransport",
    "choose_transport",
]

_OPERATION = "batch all-reduce"
_BUCKETS = "gradient all-reduce"


@runtime_checkable
class CrossWorkerTransport(Protocol):
    """Sums dense tensors across the workers of a group."""

    def all_reduce(self, tensors: list[torch.Tensor], divisor: int, check: Callable[[], None]) -> list[torch.Tensor]:
        """The sums (divided by ``divisor``) in input order; runs ``check`` before any data moves."""
        ...

    def bucket_transport(self) -> BucketTransport:
        """How gradient buckets travel with this transport (a new one for each gradient synchroniser)."""
        ...


class _OverTheGroup(abc.ABC):
    """A transport whose every byte goes through the group's collectives: no shared memory."""

    @property
    def shared_memory(self) -> None:
        """None: every byte goes through the group."""
        return None

    @abc.abstractmethod
    def all_reduce(self, tensors: list[torch.Tensor], divisor: int, check: Callable[[], None]) -> list[torch.Tensor]:
        """The sums (divided by ``divisor``) in input order; runs ``check`` before any data moves."""


@typing.final
class PackedTransport(_OverTheGroup):
    """Packed ``all_reduce`` collectives over the group."""

    def __init__(self, control: WorkerControl, bytes_per_pack: int):
        self._control = control
        self._packed = PackedAllReduce(bytes_per_pack)

    def bucket_transport(self) -> BucketTransport:
        return AllReduceBuckets(self._control)

    def all_reduce(self, tensors: list[torch.Tensor], divisor: int, check: Callable[[], None]) -> list[torch.Tensor]:
        check()
        if not tensors:
            return []
        control = self._control
        return self._packed(
            tensors, control.device, lambda pack: control.launch(_OPERATION, dist.all_reduce, pack),
            lambda work: control.wait(work, _OPERATION), divisor,
        )


@typing.final
class SharedMemoryTransport:
    """``/dev/shm`` between the workers of one host; the packed transport otherwise."""

    def __init__(self, control: WorkerControl, bytes_per_pack: int):
        self._control = control
        self._fallback = PackedTransport(control, bytes_per_pack)
        self._engine: SharedMemoryAllReduce | None = None
        self._summed = torch.zeros(1, dtype=torch.int32)

    def bucket_transport(self) -> BucketTransport:
        return SharedMemoryBuckets(self._control, self, one_shot_bytes=ONE_SHOT_BYTES)

    def announce(self, flag: torch.Tensor) -> Any:
        return _announce(self.shared_memory, lambda: self._control.launch(_BUCKETS, dist.all_reduce, flag))

    def complete(self, segments: list[SharedSegment]) -> None:
        if self.shared_memory.signals is not None:
            self.shared_memory.sync(_BUCKETS)
        else:
            self._control.call(_BUCKETS, dist.all_reduce, self._summed)

    @property
    def shared_memory(self) -> SharedMemoryAllReduce:
        """The engine (made on first use, when the group forms)."""
        if self._engine is None:
            control = self._control
            self._engine = SharedMemoryAllReduce(
                control.rank, control.world_size, lambda: control.barrier(f"{_OPERATION} (shared memory)"),
                lambda values: control.broadcast_ints(values, "shared-memory setup"),
                lambda value: control.agree_min(value, "shared-memory setup"),
                signal_group=lambda: control.group,
            )
        return self._engine

    def all_reduce(self, tensors: list[torch.Tensor], divisor: int, check: Callable[[], None]) -> list[torch.Tensor]:
        return _through_shared_memory(self.shared_memory, self._fallback, tensors, divisor, check)


@typing.final
class HierarchicalTransport:
    """Shared memory within each host, one gloo all-reduce between the hosts' leaders.

    Args:
        control: the whole group's plumbing (the per-call check, the fallback agreement).
        hosts: the host of every rank (``ResolvedCluster.task_hosts``).
        bytes_per_pack: packing of the fallback transport.
    """

    def __init__(self, control: WorkerControl, hosts: Sequence[str], bytes_per_pack: int):
        self._control = control
        self._hosts = tuple(hosts)
        self._fallback = PackedTransport(control, bytes_per_pack)
        self._engine: SharedMemoryAllReduce | None = None
        self._local: WorkerControl | None = None
        self._leaders: WorkerControl | None = None  # None on workers that do not lead their host
        self._column: WorkerControl | None = None  # this local rank on every host (equal hosts only)

    def _groups(self) -> None:
        """Forms every host's group, and the groups across hosts (collectives: every worker, same order).

        Hosts with equally many workers get one group per local rank (a "column" across
        the hosts); otherwise one group of the hosts' leaders.
        """
        group = self._control.group
        order = list(dict.fromkeys(self._hosts))  # hosts in the order of their first rank
        members = {host: [r for r, h in enumerate(self._hosts) if h == host] for host in order}
        timeout = datetime.timedelta(seconds=group.timeout)
        mine = self._hosts[group.rank]
        for host in order:
            ranks = members[host]
            handle = dist.new_group(ranks, timeout=timeout, backend=group.backend)
            if host == mine:
                self._local = WorkerControl(_subgroup(group, handle, ranks), self._control.device)
        sizes = {len(ranks) for ranks in members.values()}
        columns = ([[members[host][j] for host in order] for j in range(sizes.pop())] if len(sizes) == 1
                   else [[members[host][0] for host in order]])  # fmt: skip
        for ranks in columns:
            handle = dist.new_group(ranks, timeout=timeout, backend=group.backend)
            if group.rank in ranks:
                control = WorkerControl(_subgroup(group, handle, ranks), self._control.device)
                if len(columns) > 1:
                    self._column = control
                else:
                    self._leaders = control

    @property
    def _host(self) -> WorkerControl:
        """This host's workers' plumbing (the groups form on first use)."""
        if self._local is None:
            self._groups()
        return typing.cast(WorkerControl, self._local)  # every worker belongs to its host's group

    @property
    def shared_memory(self) -> SharedMemoryAllReduce:
        """The engine of this host's workers (made on first use, when the group forms)."""
        if self._engine is None:
            local, control = self._host, self._control
            self._engine = SharedMemoryAllReduce(
                local.rank, local.world_size, lambda: local.barrier(f"{_OPERATION} (host)"),
                lambda values: local.broadcast_ints(values, "shared-memory setup"),
                lambda value: control.agree_min(value, "shared-memory setup"),  # all hosts, or none
                after_sums=self._add_across_hosts, signal_group=lambda: local.group,
            )
        return self._engine

    def bucket_transport(self) -> BucketTransport:
        return PipelinedHostBuckets(self._control, self)

    @property
    def slices_cross_hosts(self) -> bool:
        """Whether each worker adds its own slice across hosts (equal hosts: columns), not leaders.

        Forms the groups on first use (a collective: every worker asks at the same point).
        """
        self._host  # noqa: B018 - the groups exist from here on
        return self._column is not None

    def start_across_hosts(self, segment: SharedSegment) -> list[Any]:
        """Starts adding this worker's summed slice of ``segment`` across hosts (columns only).

        Returns the collective's works; ``finish_across_hosts`` waits for them. The
        gradient buckets call it bucket by bucket while backward goes on, so the trip
        between hosts overlaps the rest of backward as DDP's all-reduce does.
        """
        engine, column = self.shared_memory, self._column
        assert column is not None, "start_across_hosts needs equal hosts (slices_cross_hosts)"
        start, end = engine.my_slice(segment.result.numel())
        if end <= start:
            return []
        return [column.launch(_OPERATION, dist.all_reduce, segment.result[start:end])]

    def finish_across_hosts(self, works: list[Any]) -> None:
        """Waits for the works of ``start_across_hosts``, then until every slice on this host is final."""
        self._wait_across(works)
        self.shared_memory.sync(f"{_BUCKETS} (host)")

    def _wait_across(self, works: list[Any]) -> None:
        column = self._column
        assert column is not None, "only equal hosts add slices across hosts (slices_cross_hosts)"
        for work in works:
            column.wait(work, f"{_OPERATION} (between hosts)")

    def _add_across_hosts(self, segments: list[SharedSegment]) -> None:
        """Adds the hosts' sums (called by every worker once it summed its slices).

        Columns: this worker all-reduces its own slice of every result with the workers
        of its local rank on the other hosts. Leaders: once the host's sums are complete,
        its leader all-reduces them whole. The caller then synchronises the host.
        """
        engine, column = self.shared_memory, self._column
        if column is not None:
            self._wait_across([work for segment in segments for work in self.start_across_hosts(segment)])
            return
        self._host  # noqa: B018 - the groups exist from here on
        engine.sync(f"{_OPERATION} (host)")
        leaders = self._leaders
        if leaders is not None:
            works = [leaders.launch(_OPERATION, dist.all_reduce, segment.result) for segment in segments]
            for work in works:
                leaders.wait(work, f"{_OPERATION} (between hosts)")

    def announce(self, flag: torch.Tensor) -> Any:
        return _announce(self.shared_memory, lambda: self._host.launch(_BUCKETS, dist.all_reduce, flag))

    def complete(self, segments: list[SharedSegment]) -> None:
        self._add_across_hosts(segments)
        self.shared_memory.sync(f"{_BUCKETS} (host)")

    def all_reduce(self, tensors: list[torch.Tensor], divisor: int, check: Callable[[], None]) -> list[torch.Tensor]:
        return _through_shared_memory(self.shared_memory, self._fallback, tensors, divisor, check)


def _through_shared_memory(engine: SharedMemoryAllReduce, fallback: PackedTransport, tensors: list[torch.Tensor],
                           divisor: int, check: Callable[[], None]) -> list[torch.Tensor]:
    """The shared-memory path, or the packed one for tensors it does not take (or once it gave up)."""
    if tensors and engine.eligible(tensors):
        reduced = engine(tensors, divisor, check)
        if reduced is not None:
            return reduced
        return fallback.all_reduce(tensors, divisor, lambda: None)  # the check has run
    return fallback.all_reduce(tensors, divisor, check)


class _Posted:
    """A work handle for 'every worker of the host posted this bucket': waits on the shared counters."""

    def __init__(self, engine: SharedMemoryAllReduce, count: int):
        self._engine, self._count = engine, count

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        signals = self._engine.signals
        assert signals is not None
        signals.wait(WRITTEN, self._count, timeout.total_seconds() if timeout is not None else None)
        return True

    def is_completed(self) -> bool:
        """Whether every worker of the host posted this bucket (without waiting), as a work's ``is_completed``."""
        signals = self._engine.signals
        assert signals is not None
        return signals.reached(WRITTEN, self._count)


def _announce(engine: SharedMemoryAllReduce, through_group: Callable[[], Any]) -> Any:
    """Says that this worker's slot of the next bucket is written: a shared counter, else a tiny collective."""
    signals = engine.signals
    if signals is None:
        return through_group()
    return _Posted(engine, signals.post(WRITTEN))


@typing.final
class CompressedTransport(_OverTheGroup):
    """Packed collectives whose floating-point tensors travel as bfloat16 or float16 (``compression.py``).

    Every byte goes through the group, shared memory or not: the point is fewer bytes on
    the network. Tensors the compression does not take (integers, half types already)
    and float16 sums that overflowed go exactly, in a second packed call.
    """

    def __init__(self, control: WorkerControl, bytes_per_pack: int, compression: Compression):
        self._control = control
        self._packed = PackedTransport(control, bytes_per_pack)
        self.compressor = Compressor(compression)

    def bucket_transport(self) -> BucketTransport:
        return CompressedBuckets(self._control, self.compressor)

    def all_reduce(self, tensors: list[torch.Tensor], divisor: int, check: Callable[[], None]) -> list[torch.Tensor]:
        check()
        compressor = self.compressor
        results = list(tensors)
        compressed = [i for i, t in enumerate(tensors) if compressor.compresses(t)]
        exact = [i for i, t in enumerate(tensors) if not compressor.compresses(t)]
        if compressed:
            wires = [compressor.to_wire(tensors[i], divisor) for i in compressed]
            for i, reduced in zip(compressed, self._packed.all_reduce(wires, 1, _checked)):
                if compressor.overflowed(reduced):
                    exact.append(i)  # the same on every worker: they all hold this very sum
                else:
                    results[i] = reduced.to(tensors[i].dtype)
        if exact:
            exact.sort()
            for i, reduced in zip(exact, self._packed.all_reduce([tensors[i] for i in exact], divisor, _checked)):
                results[i] = reduced
        return results


@typing.final
class PowerSGDTransport(_OverTheGroup):
    """Exact packed collectives for batches; gradient buckets reduced by PowerSGD (``powersgd.py``)."""

    def __init__(self, control: WorkerControl, bytes_per_pack: int, config: PowerSGD):
        self._packed = PackedTransport(control, bytes_per_pack)
        self.powersgd = PowerSGDReducer(config, lambda tensors: self._packed.all_reduce(tensors, 1, _checked),
                                        control.world_size)

    def bucket_transport(self) -> BucketTransport:
        return PowerSGDBuckets(self.powersgd)

    def all_reduce(self, tensors: list[torch.Tensor], divisor: int, check: Callable[[], None]) -> list[torch.Tensor]:
        return self._packed.all_reduce(tensors, divisor, check)


def _checked() -> None:
    """The per-call check already ran."""


def _subgroup(group: WorkerGroup, handle: Any, ranks: list[int]) -> WorkerGroup:
    """A WorkerGroup for a subgroup of ``group``: its own rank, names and process group handle."""
    return WorkerGroup(handle, None, ranks.index(group.rank), len(ranks), [group.names[r] for r in ranks],
                       group.backend, group.timeout, group.liveness, group.restart_advice)


def choose_transport(control: WorkerControl, options: CommunicationOptions, backend: str,
                     hosts: Sequence[str] | None = None, *, replicas_on_cuda: bool = False) -> CrossWorkerTransport:
    """The transport for a group, from its backend and (when known) which workers share a host.

    With AUTO on gloo: shared memory when every worker is on one host (or the hosts are
    unknown: it falls back by itself when they cannot map each other's files);
    hierarchical when several hosts have several workers; packed collectives when every
    host has one worker. Packed collectives otherwise (RING, NCCL, and gloo between
    replicas on GPUs: the shared-memory files and their results live in host memory,
    while the gradient buckets stay on the GPU, so gloo's staging does the same
    copies with no second path to keep). With compression:
    compressed packed collectives, whatever the hosts.
    """
    if isinstance(options.compression, PowerSGD):
        return PowerSGDTransport(control, options.bytes_per_pack, options.compression)
    if options.compression is not Compression.NONE:
        return CompressedTransport(control, options.bytes_per_pack, options.compression)
    if options.implementation is not CommunicationImplementation.AUTO or backend != "gloo" or replicas_on_cuda:
        return PackedTransport(control, options.bytes_per_pack)
    if not hosts or len(set(hosts)) == 1:
        return SharedMemoryTransport(control, options.bytes_per_pack)
    if len(set(hosts)) == len(hosts):
        return PackedTransport(control, options.bytes_per_pack)
    return HierarchicalTransport(control, hosts, options.bytes_per_pack)


