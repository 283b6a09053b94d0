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
  host cannot give the memory. With bf16 / fp16 compression the hop between hosts
  carries the host sums in the half type, while the sums within a host stay exact.
- ``CompressedTransport``: packed collectives in bfloat16 or float16 (one host, RING,
  NCCL, or one worker per host);
- ``PowerSGDTransport``: gradient buckets through PowerSGD, whose factors (and exact
  tensors) are summed by the exact transport the hosts call for (hierarchical across
  hosts, so the factors cross the network once per host, not once per worker).

All take the per-call check as an argument and run it before any data moves. Each
names the way gradient buckets travel with it (``bucket_transport``, one of
``bucket_transports.py``): over the group, compressed, through PowerSGD, or in the shared
files, where a full bucket only announces itself and the transport completes the sums.
"""

from __future__ import annotations

import abc
import typing
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

from unison._collectives.group.worker_control import WorkerControl
from unison._collectives.options import CommunicationImplementation, CommunicationOptions, Compression, PowerSGD
from unison._collectives.transport.bucket_transports import (
    AllReduceBuckets,
    BucketTransport,
    CompressedBuckets,
    PowerSGDBuckets,
)
from unison._collectives.transport.compression import Compressor
from unison._collectives.transport.host_share import BATCH_OPERATION, HostsShare, OneHostShare
from unison._collectives.transport.packed_all_reduce import PackedAllReduce
from unison._collectives.transport.powersgd import PowerSGDReducer
from unison._collectives.transport.shared_buckets import ONE_SHOT_BYTES, PipelinedHostBuckets, SharedMemoryBuckets
from unison._collectives.transport.shared_memory import SharedMemoryAllReduce
from unison._collectives.transport.shm_signals import SharedSignals

__all__ = [
    "CrossWorkerTransport",
    "PackedTransport",
    "SharedMemoryTransport",
    "HierarchicalTransport",
    "CompressedTransport",
    "PowerSGDTransport",
    "choose_transport",
]



@runtime_checkable
class CrossWorkerTransport(Protocol):
    """Sums dense tensors across the workers of a group."""

    def all_reduce(self, tensors: list[torch.Tensor], divisor: int, check: Callable[[], None]) -> list[torch.Tensor]:
        """The sums (divided by ``divisor``) in input order; runs ``check`` before any data moves."""
        ...

    def bucket_transport(self) -> BucketTransport:
        """How gradient buckets travel with this transport (a new one for each gradient synchroniser)."""
        ...

    def call_signals(self) -> SharedSignals | None:
        """Where the per-call check's signatures meet: the shared counters of the one host every worker
        of the group is on, once they exist; None: in a collective of the group."""
        ...


class _OverTheGroup(abc.ABC):
    """A transport whose every byte goes through the group's collectives: no shared memory."""

    @property
    def shared_memory(self) -> None:
        """None: every byte goes through the group."""
        return None

    def call_signals(self) -> None:
        """None: the per-call check is a collective of the group."""
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

    def sum_checked(self, tensors: list[torch.Tensor], divisor: int) -> list[torch.Tensor]:
        """``all_reduce`` of tensors whose layout the caller checked already (the same on every worker)."""
        return self.all_reduce(tensors, divisor, _checked)

    def all_reduce(self, tensors: list[torch.Tensor], divisor: int, check: Callable[[], None]) -> list[torch.Tensor]:
        check()
        if not tensors:
            return []
        control = self._control
        return self._packed(
            tensors, control.device, lambda pack: control.launch(BATCH_OPERATION, dist.all_reduce, pack),
            lambda work: control.wait(work, BATCH_OPERATION), divisor,
        )


@typing.final
class SharedMemoryTransport:
    """``/dev/shm`` between the workers of one host; the packed transport otherwise."""

    def __init__(self, control: WorkerControl, bytes_per_pack: int):
        self._control = control
        self._fallback = PackedTransport(control, bytes_per_pack)
        self.share = OneHostShare(control)

    def bucket_transport(self) -> BucketTransport:
        return SharedMemoryBuckets(self._control, self.share, one_shot_bytes=ONE_SHOT_BYTES, homes=True)

    @property
    def shared_memory(self) -> SharedMemoryAllReduce:
        """The engine (made on first use, when the group forms)."""
        return self.share.shared_memory

    def call_signals(self) -> SharedSignals | None:
        """The host's shared counters, once the first shared file made them: every worker of the group
        is on this host, so a signature compared there is compared with every worker's. A gloo
        all-gather per checked call was most of a small reduce (``benchmarks/RESULTS.md``)."""
        return self.share.shared_memory.signals

    def all_reduce(self, tensors: list[torch.Tensor], divisor: int, check: Callable[[], None]) -> list[torch.Tensor]:
        return _through_shared_memory(self.share.shared_memory, self._fallback, tensors, divisor, check)


@typing.final
class HierarchicalTransport:
    """Shared memory within each host, the hosts' sums added across hosts (``host_share.HostsShare``).

    Args:
        control: the whole group's plumbing (the per-call check, the fallback agreement).
        hosts: the host of every rank (``ResolvedCluster.task_hosts``).
        bytes_per_pack: packing of the fallback transport.
        compression: ``BF16`` / ``FP16``: floating-point host sums cross hosts in the half
            type (the sums within a host stay exact; the fallback is compressed too);
            ``NONE``: exact.
    """

    def __init__(self, control: WorkerControl, hosts: Sequence[str], bytes_per_pack: int,
                 compression: Compression = Compression.NONE):
        self._control = control
        self.compressor = None if compression is Compression.NONE else Compressor(compression)
        self._fallback: PackedTransport | CompressedTransport = (
            PackedTransport(control, bytes_per_pack) if compression is Compression.NONE
            else CompressedTransport(control, bytes_per_pack, compression))
        self.share = HostsShare(control, hosts, self.compressor)

    @property
    def shared_memory(self) -> SharedMemoryAllReduce:
        """The engine of this host's workers (made on first use, when the group forms)."""
        return self.share.shared_memory

    def bucket_transport(self) -> BucketTransport:
        return PipelinedHostBuckets(self._control, self.share, fallback=self._fallback.bucket_transport)

    def call_signals(self) -> None:
        """None: a host's counters see its own workers only, and the check spans the hosts."""
        return None

    def all_reduce(self, tensors: list[torch.Tensor], divisor: int, check: Callable[[], None]) -> list[torch.Tensor]:
        return _through_shared_memory(self.share.shared_memory, self._fallback, tensors, divisor, check)

    def sum_checked(self, tensors: list[torch.Tensor], divisor: int) -> list[torch.Tensor]:
        """``all_reduce`` of tensors whose layout the caller checked already (the same on every worker).

        Not ``all_reduce`` with a no-op check: in shared memory the check doubles as the
        barrier after every worker wrote its inputs, and here the engine must wait itself.
        """
        return _through_shared_memory(self.share.shared_memory, self._fallback, tensors, divisor, None)


def _through_shared_memory(engine: SharedMemoryAllReduce, fallback: CrossWorkerTransport, tensors: list[torch.Tensor],
                           divisor: int, check: Callable[[], None] | None) -> list[torch.Tensor]:
    """The shared-memory path, or the packed one for tensors it does not take (or once it gave up).

    ``check``: the per-call layout check (a collective that doubles as the barrier after
    the inputs are written); None where the caller checked already (the engine then
    waits for the inputs with a barrier of its own)."""
    if tensors and engine.eligible(tensors):
        reduced = engine(tensors, divisor, check)
        if reduced is not None:
            return reduced
        return fallback.all_reduce(tensors, divisor, _checked)  # the check has run
    return fallback.all_reduce(tensors, divisor, check if check is not None else _checked)


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
class PowerSGDTransport:
    """Gradient buckets reduced by PowerSGD (``powersgd.py``); its sums, and batches, by an exact transport.

    Args:
        control: the group's plumbing (its size: how many workers' errors add up).
        config: the user's PowerSGD options.
        exact: what sums the factors, the tensors PowerSGD leaves exact, and batch
            reductions: packed collectives, or on several hosts the hierarchical transport
            (the factors then cross the network once per host sum, not once per worker).
    """

    def __init__(self, control: WorkerControl, config: PowerSGD, exact: PackedTransport | HierarchicalTransport):
        self.exact = exact
        self.powersgd = PowerSGDReducer(config, lambda tensors: exact.sum_checked(tensors, 1), control.world_size)

    @property
    def shared_memory(self) -> SharedMemoryAllReduce | None:
        """The exact transport's shared-memory engine (None: every byte goes through the group)."""
        return self.exact.shared_memory

    def bucket_transport(self) -> BucketTransport:
        return PowerSGDBuckets(self.powersgd)

    def call_signals(self) -> SharedSignals | None:
        """The exact transport's (None: packed or hierarchical, where the check is a collective)."""
        return self.exact.call_signals()

    def all_reduce(self, tensors: list[torch.Tensor], divisor: int, check: Callable[[], None]) -> list[torch.Tensor]:
        return self.exact.all_reduce(tensors, divisor, check)


def _checked() -> None:
    """The per-call check already ran."""


def choose_transport(control: WorkerControl, options: CommunicationOptions, backend: str,
                     hosts: Sequence[str] | None = None, *, replicas_on_cuda: bool = False) -> CrossWorkerTransport:
    """The transport for a group, from its backend and (when known) which workers share a host.

    With AUTO on gloo: shared memory when every worker is on one host (or the hosts are
    unknown: it falls back by itself when they cannot map each other's files);
    hierarchical when several hosts have several workers; packed collectives when every
    host has one worker. Packed collectives otherwise (RING, NCCL, and gloo between
    replicas on GPUs: the shared-memory files and their results live in host memory,
    while the gradient buckets stay on the GPU, so gloo's staging does the same
    copies with no second path to keep).

    With compression, where the hosts call for the hierarchical transport, it is the
    hierarchical transport that compresses: bf16 / fp16 on the hop between hosts (the
    sums within a host exact), PowerSGD's factors summed hierarchically. Elsewhere (one
    host, RING, NCCL, one worker per host): compressed packed collectives, or PowerSGD
    over packed collectives.
    """
    pack, hosts = options.bytes_per_pack, tuple(hosts or ())
    hierarchical = (options.implementation is CommunicationImplementation.AUTO and backend == "gloo"
                    and not replicas_on_cuda and 1 < len(set(hosts)) < len(hosts))  # fmt: skip
    compression = options.compression
    if isinstance(compression, PowerSGD):
        exact = HierarchicalTransport(control, hosts, pack) if hierarchical else PackedTransport(control, pack)
        return PowerSGDTransport(control, compression, exact)
    if hierarchical:
        return HierarchicalTransport(control, hosts, pack, compression)
    if compression is not Compression.NONE:
        return CompressedTransport(control, pack, compression)
    if options.implementation is not CommunicationImplementation.AUTO or backend != "gloo" or replicas_on_cuda:
        return PackedTransport(control, pack)
    if not hosts or len(set(hosts)) == 1:
        return SharedMemoryTransport(control, pack)
    return PackedTransport(control, pack)  # one worker per host: nothing to share


