"""Bucket transports through the shared memory of a host (the contract: ``bucket_transports.py``).

:class:`SharedMemoryBuckets`: the workers of one host share one file per bucket; each sums
a slice of everyone's (or, for a small bucket, all of it) when backward ends.
:class:`PipelinedHostBuckets`: several hosts, each bucket's slices crossing hosts while
backward runs. Both fall back to ``AllReduceBuckets`` where the workers cannot share a file
(or to the bucket transport their cross-worker transport names: ``CompressedBuckets``
when the hop between hosts is compressed).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable
from typing import Any

import torch

from unison._collectives.group.worker_control import WorkerControl
from unison._collectives.transport.bucket_transports import (
    DEFAULT_BUCKET_BYTES,
    OPERATION,
    AllReduceBuckets,
    BucketTransport,
    GradientBucket,
    HandOut,
)
from unison._collectives.transport.flat_buffers import views_of
from unison._collectives.transport.shared_memory import SharedMemoryAllReduce, SharedSegment

__all__ = ["ONE_SHOT_BYTES", "PIPELINED_BUCKET_BYTES", "BUCKET_BYTES_ON_SLOW_LINKS", "PipelinedHostBuckets",
           "SharedMemoryBuckets", "bucket_bytes_for_link"]

PIPELINED_BUCKET_BYTES = 2 * 1024 * 1024
"""Default bucket size when buckets cross hosts one by one during backward: small enough
that a model's first buckets leave early, large enough to keep the collectives few."""

BUCKET_BYTES_ON_SLOW_LINKS = ((40_000_000, 512 * 1024), (125_000_000, 1024 * 1024))
"""``(rate, bytes)`` pairs, slowest first: where a host's slice crosses hosts slower than ``rate``
bytes a second (``HostsShare.link_bytes_per_second``), buckets are ``bytes`` instead of
``PIPELINED_BUCKET_BYTES``. On a slow link the step is the compute before the first bucket
leaves plus the link's time, so the first bucket should leave sooner; the extra collectives
cost less there than on a fast link. Two simulated hosts of two workers on two cores
(``benchmarks/multi_host.py``) read 7, 16-23, 60 and 200-440 MB/s with links of 100 Mbit/s,
250 Mbit/s, 1 Gbit/s and unlimited. On W2 at 250 Mbit/s 512 KB buckets ran 1.34x DDP against
1.31x for 1 MB (six pairs) and 1 MB 1.29x against 1.21x for 2 MB; at 1 Gbit/s 1 MB 1.09x
against 1.07x; unlimited, 2 MB 1.02x against 0.99x for 1 MB (``benchmarks/RESULTS.md``)."""

ONE_SHOT_BYTES = 64 * 1024
"""Up to this size a bucket in one host's shared memory is summed whole by every worker: one
wait instead of two (a reduce-scatter's barrier, then the all-gather's), for one add over
bytes that fit a core's cache. Above it, each worker sums its slice, so the work divides."""


class _HostShare(typing.Protocol):
    """What the shared-memory bucket transports are given: the host's files and signals (``host_share.py``)."""

    @property
    def shared_memory(self) -> SharedMemoryAllReduce: ...

    def announce(self, flag: torch.Tensor) -> Any: ...

    def complete(self, segments: list[SharedSegment]) -> None: ...


@dataclasses.dataclass(eq=False)
class _Halves:
    """A small shared bucket: two input slots per worker, used in turn, summed whole by every worker.

    Every worker adds all the inputs of a finished bucket into its own ``sums`` (in worker
    order, as a slice's owner would: the same numbers everywhere), so no second barrier
    ("every slice summed") is needed. The next step writes the other half; a worker writes
    a half again only two steps later, after every peer announced the step between, which
    it did after it had read this one.
    """

    inputs: list[list[torch.Tensor]]  # [half][rank]: that worker's input slot in that half
    flats: list[torch.Tensor]  # [half]: this worker's slot
    views: list[list[torch.Tensor]]  # [half]: this worker's per-parameter views of its slot
    sums: torch.Tensor  # this worker's own: the totals, handed out from here
    turn: int = 0

    def add_up(self) -> None:
        inputs = self.inputs[self.turn]
        torch.add(inputs[0], inputs[1], out=self.sums)
        for more in inputs[2:]:
            self.sums.add_(more)


@dataclasses.dataclass(eq=False)
class _Homes:
    """A bucket whose gradients live in their worker's part of the shared file, its home.

    The file holds every worker's home, then every worker's spare, then one word per worker
    (``away``); ``_carve_homes`` lays them out. Each slice's owner sums every worker's slice,
    in worker order, and writes the sums back into every worker's home: no copy out of a
    result. Many small gradients (``wants_slots``) live in the home from the second step on
    (autograd accumulates into it, undivided: the owner divides as it sums), so none is
    copied into the file either; a few large ones are divided into it, and the sums are
    handed out as views of it. A worker whose home someone outside holds (a gradient kept
    from an earlier step, a view of one) leaves it for good: it says so in ``away`` (read
    by the owners once every worker announced the bucket), its gradients go through its
    spare and are copied out of it, and no one writes its home again.
    """

    homes: list[torch.Tensor]  # [rank]: that worker's home: gradients, then flags
    spares: list[torch.Tensor]  # [rank]: where that worker's gradients go once it left its home
    away: torch.Tensor  # [rank]: 1 once that worker left its home
    mine: torch.Tensor  # this worker's: its home, or its spare once it left (in the handed-out mapping)
    my_spare: torch.Tensor  # this worker's spare, in the handed-out mapping
    divisor: int = 1  # what the sums are divided by while summed this step (1 or a power of two)

    def in_use(self) -> list[torch.Tensor]:
        """Where each worker's gradients are this step (read after every worker announced it)."""
        return [spare if left else home for home, spare, left in zip(self.homes, self.spares, self.away.tolist())]


def _home_file_elements(numel: int, world_size: int) -> int:
    """What to ask ``new_segment`` for so that its storage holds ``_carve_homes``'s layout:
    a segment has ``world_size + 1`` slots of that many elements."""
    return -(-(2 * world_size * numel + world_size) // (world_size + 1))


def _carve_homes(segment: SharedSegment, numel: int, world_size: int, rank: int) -> _Homes:
    """Every worker's home, then every worker's spare (``numel`` elements each), then the
    ``away`` words, out of a segment of ``_home_file_elements`` (its slots and result unused).

    This worker's own home and spare (``mine``, ``my_spare``) come from the segment's
    ``handed_out`` mapping where it has one: the gradients' slots and views count the
    holders of that storage to tell a gradient a user kept (``GradSlots.held_elsewhere``,
    ``home_held_elsewhere``), and the transport's views, which sum and cross hosts on the
    other mapping, are then never among them."""
    storage = segment.storage
    homes = [storage[r * numel:(r + 1) * numel] for r in range(world_size)]
    spares = [storage[(world_size + r) * numel:(world_size + r + 1) * numel] for r in range(world_size)]
    away = storage[2 * world_size * numel:2 * world_size * numel + world_size]
    own = segment.handed_out if segment.handed_out is not None else storage
    return _Homes(homes, spares, away, own[rank * numel:(rank + 1) * numel],
                  own[(world_size + rank) * numel:(world_size + rank + 1) * numel])


@dataclasses.dataclass(eq=False)
class _InSharedFile:
    """A bucket's place in the shared files: its segment, the views of its sums, and the transport's per-step state.

    Kept by ``id`` of the bucket, never the bucket itself: a rebuild must find a dropped
    model's parameters unreferenced (``BucketedGradientSync.finalize``)."""

    segment: SharedSegment
    results: list[torch.Tensor]  # per parameter, views of the sums (the segment's result, the halves', the home's)
    halves: _Halves | None = None  # a small bucket summed whole by every worker
    homes: _Homes | None = None  # a bucket whose gradients live in the file
    written: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros(1, dtype=torch.int32))
    across: list[Any] = dataclasses.field(default_factory=list)  # pipelined: the works adding it across hosts

    @property
    def sums(self) -> torch.Tensor:
        """The reduced flat (gradients, then the flags' sums)."""
        if self.halves is not None:
            return self.halves.sums
        return self.homes.mine if self.homes is not None else self.segment.result


def _leave_home(placed: _InSharedFile, bucket: GradientBucket, rank: int) -> None:
    """A transport's ``leave_home`` for a bucket with :class:`_Homes`: this worker's gradients go
    through its spare from now on, and the owners are told (``away``)."""
    homes = placed.homes
    assert homes is not None and bucket.home is not None, "leave_home: the bucket has no home"
    homes.away[rank] = 1  # the owners read it once this worker announced the bucket
    homes.mine = homes.my_spare
    bucket.flat, bucket.views, bucket.home = homes.mine, views_of(homes.mine[:bucket.size], bucket.params), None
    placed.results = bucket.views


def _summed_as(homes: _Homes, bucket: GradientBucket, divisor: int) -> None:
    """Sets what a launched bucket's home is divided by while summed: ``divisor`` where it holds the
    gradients undivided and that is exact (a power of two; otherwise it is divided now), else 1."""
    homes.divisor = 1
    if bucket.undivided:
        homes.divisor = divisor if divisor & (divisor - 1) == 0 else 1
        if homes.divisor != divisor:
            homes.mine[:bucket.size].div_(divisor)


def _into_shared_memory(engine: SharedMemoryAllReduce, buckets: list[GradientBucket],
                        one_shot_bytes: int = 0, homes: bool = False) -> dict[int, _InSharedFile] | None:
    """Moves every bucket's flat into a slot of a shared file; None (nothing moved) where the workers cannot share one.

    A bucket of at most ``one_shot_bytes`` (on a host of two workers or more) gets two
    slots per worker, used in turn, and is summed whole by each (:class:`_Halves`). With
    ``homes``, a larger one gets a home in the file (:class:`_Homes`)."""
    if not engine.available or not buckets or any(not b.flat.is_cpu or b.flat.numel() == 0 for b in buckets):
        return None
    whole = [engine.world_size > 1 and b.flat.numel() * b.flat.element_size() <= one_shot_bytes for b in buckets]
    at_home = [homes and engine.world_size > 1 and not small for small in whole]
    segments = []
    for bucket, halves, home in zip(buckets, whole, at_home, strict=True):
        numel = bucket.flat.numel()
        if home:
            numel = _home_file_elements(numel, engine.world_size)
        segment = engine.new_segment(bucket.flat.dtype, numel * 2 if halves else numel, handed_out=home)
        if segment is None:
            return None  # the workers cannot share memory: every bucket stays on the group
        segments.append(segment)
    placed = {}
    for bucket, segment, halves, home in zip(buckets, segments, whole, at_home, strict=True):
        size, numel = bucket.size, bucket.flat.numel()
        if home:  # its own layout: the segment's slots overlap other workers' homes, never touched here
            kept = _carve_homes(segment, numel, engine.world_size, engine.rank)
            kept.mine.zero_()
            kept.my_spare.zero_()
            bucket.flat, bucket.views, bucket.home = kept.mine, views_of(kept.mine[:size], bucket.params), \
                kept.mine[:size]
            bucket.undivided = bucket.wants_slots  # in the home: the owner divides; else the fill does
            bucket.used  # noqa: B018 - its view made now: the gradients' slots count who holds the file
            placed[id(bucket)] = _InSharedFile(segment, bucket.views, homes=kept)
            continue
        slot = engine.my_slot(segment)
        slot.zero_()
        if halves:
            inputs = [[peer[h * numel:(h + 1) * numel] for peer in segment.inputs] for h in (0, 1)]
            mine = [inputs[h][engine.rank] for h in (0, 1)]
            sums = torch.zeros(numel, dtype=bucket.flat.dtype)
            pair = _Halves(inputs, mine, [views_of(flat[:size], bucket.params) for flat in mine], sums)
            bucket.flat, bucket.views = mine[0], pair.views[0]
            placed[id(bucket)] = _InSharedFile(segment, views_of(sums[:size], bucket.params), pair)
        else:
            bucket.flat, bucket.views = slot, views_of(slot[:size], bucket.params)
            placed[id(bucket)] = _InSharedFile(segment, views_of(segment.result[:size], bucket.params))
    return placed


@typing.final
class SharedMemoryBuckets(BucketTransport):
    """The workers of a host share one file per bucket; each sums a slice of everyone's when backward ends.

    A full bucket only says that this worker's slot is written (a shared counter); when
    backward ends each worker sums its slice of every bucket and, once every worker has
    (and, on several hosts, the hosts' sums are added), copies the totals out. A bucket of
    at most ``one_shot_bytes`` (one host only) is summed whole by every worker instead,
    from two slots used in turn (:class:`_Halves`): one wait a step rather than two, which
    is most of the cost of synchronising a small model. With ``homes`` (one host only), a
    larger bucket's sums come back into each worker's part of the file, where many small
    gradients live and which a few large ones are handed out as views of (:class:`_Homes`).
    Falls back to :class:`AllReduceBuckets` where the workers cannot share a file.
    """

    def __init__(self, control: WorkerControl, share: _HostShare, one_shot_bytes: int = 0,
                 fallback: Callable[[], BucketTransport] | None = None, homes: bool = False):
        self._control = control
        self._share = share
        self._one_shot_bytes = one_shot_bytes
        self._homes = homes
        self._fallback = fallback if fallback is not None else (lambda: AllReduceBuckets(control))
        self._placed: dict[int, _InSharedFile] = {}

    @property
    def overlaps_backward(self) -> bool:
        return False

    @property
    def hand_out(self) -> HandOut:
        return HandOut.COPIES  # a peer zeroing its gradients in place must not zero the shared result

    @property
    def in_shared_memory(self) -> bool:
        return True

    def plan(self, buckets: list[GradientBucket]) -> BucketTransport:
        placed = _into_shared_memory(self._share.shared_memory, buckets, self._one_shot_bytes, self._homes)
        if placed is None:
            return self._fallback().plan(buckets)
        self._placed = placed
        return self

    def adopt(self, placed: dict[int, _InSharedFile]) -> SharedMemoryBuckets:
        """Carries buckets another shared-memory transport already placed (the hierarchical one's fallback)."""
        self._placed = placed
        return self

    def leave_home(self, bucket: GradientBucket) -> None:
        _leave_home(self._placed[id(bucket)], bucket, self._share.shared_memory.rank)

    def own_range(self, bucket: GradientBucket) -> tuple[int, int] | None:
        """A few large gradients divided into a home: the owner of a slice reads its own part of it
        from its gradients, so that part is never copied into the file (on two workers, a worker's
        reduction then moves 3.5 times its gradients' bytes instead of 4.5)."""
        placed = self._placed.get(id(bucket))
        if placed is None or placed.homes is None or bucket.undivided:
            return None
        start, end = self._share.shared_memory.my_slice(bucket.flat.numel())
        end = min(end, bucket.size)  # the flags are always written
        return (start, end) if start < end else None

    def launch(self, bucket: GradientBucket, divisor: int) -> None:
        placed = self._placed[id(bucket)]
        if placed.homes is not None:
            _summed_as(placed.homes, bucket, divisor)
        bucket.work = self._share.announce(placed.written)

    def finish(self, buckets: list[GradientBucket]) -> None:
        engine = self._share.shared_memory
        for bucket in buckets:
            self._control.wait(bucket.work, OPERATION)
        sliced = []
        for bucket in buckets:
            placed = self._placed[id(bucket)]
            halves = placed.halves
            if placed.homes is not None:
                own, bucket.own_parts = bucket.own_parts or (), None
                engine.sum_my_slice_into(placed.homes.in_use(), placed.homes.divisor, own, bucket.own_divisor)
                sliced.append(placed.segment)
            elif halves is None:
                engine.sum_my_slice(placed.segment)
                sliced.append(placed.segment)
            else:
                halves.add_up()
                turn = halves.turn = halves.turn ^ 1  # the next step writes the other half
                bucket.flat, bucket.views = halves.flats[turn], halves.views[turn]
        if sliced:
            self._share.complete(sliced)

    def sums(self, bucket: GradientBucket) -> torch.Tensor:
        return self._placed[id(bucket)].sums

    def sum_views(self, bucket: GradientBucket) -> list[torch.Tensor]:
        return self._placed[id(bucket)].results

    @property
    def shared_counters(self) -> bool:
        """Whether the workers signal through counters in the shared file (else tiny collectives; diagnostics)."""
        return self._share.shared_memory.signals is not None


def bucket_bytes_for_link(rate: int) -> int:
    """The default size of buckets that cross hosts during backward over a link of ``rate`` bytes a
    second (``BUCKET_BYTES_ON_SLOW_LINKS``, else ``PIPELINED_BUCKET_BYTES``)."""
    return next((size for below, size in BUCKET_BYTES_ON_SLOW_LINKS if rate < below), PIPELINED_BUCKET_BYTES)


class _AcrossHosts(typing.Protocol):
    """What the hierarchical bucket transport is given: the host's files, and sending a slice across hosts."""

    @property
    def shared_memory(self) -> SharedMemoryAllReduce: ...

    def announce(self, flag: torch.Tensor) -> Any: ...

    def complete(self, segments: list[SharedSegment]) -> None: ...

    @property
    def slices_cross_hosts(self) -> bool: ...

    def start_across_hosts(self, summed: torch.Tensor) -> list[Any]: ...

    def link_bytes_per_second(self) -> int: ...

    def wait_across_hosts(self, works: list[Any]) -> None: ...

    def sync_host(self) -> None: ...


@typing.final
class PipelinedHostBuckets(BucketTransport):
    """Several hosts with equally many workers: each bucket's slices cross hosts while backward runs.

    Each bucket goes into its slot as soon as it is complete; as soon as every worker of
    the host wrote it (a look at the shared counters from a later hook, never a wait),
    this worker sums its slice and starts that slice's all-reduce with the same slice
    on the other hosts. Where the hosts differ in size (one leader per host adds the
    sums) or a host has no shared counters, its plan is :class:`SharedMemoryBuckets`
    (the hosts' sums added when backward ends).

    On hosts of two workers or more, every bucket has a home in the file for each worker
    (:class:`_Homes`, as on one host): many small gradients live there, a few large ones
    are divided into it and handed out as views of it. A slice's owner sums its slice of
    every worker's home into the first worker's (:meth:`SharedMemoryAllReduce.sum_my_slice_in_first`),
    that slice crosses hosts in place, and once back the owner copies it into the other
    homes: no copy into a slot of the file, none out of a result.
    """

    def __init__(self, control: WorkerControl, hosts: _AcrossHosts,
                 fallback: Callable[[], BucketTransport] | None = None):
        self._control = control
        self._hosts = hosts
        self._fallback = fallback if fallback is not None else (lambda: AllReduceBuckets(control))
        self._placed: dict[int, _InSharedFile] = {}
        self._launched: list[GradientBucket] = []  # this backward's, in launch order (the buckets' order)
        self._started = 0
        self._default_bytes: int | None = None  # chosen by the link's speed, once
        self.started_during_backward = 0
        """How many buckets of the last backward pass started across hosts before it ended (diagnostics)."""

    @property
    def overlaps_backward(self) -> bool:
        return True

    @property
    def hand_out(self) -> HandOut:
        return HandOut.COPIES

    @property
    def in_shared_memory(self) -> bool:
        return True

    def default_bucket_bytes(self) -> int:
        """Smaller buckets where they cross hosts during backward: more of the trip overlaps; smaller
        still where the link is slow (a probe of it, the first time). (Forms the host groups on first
        use: a collective, asked where the buckets are built.)"""
        if not self._hosts.slices_cross_hosts:
            return DEFAULT_BUCKET_BYTES
        if self._default_bytes is None:
            self._default_bytes = bucket_bytes_for_link(self._hosts.link_bytes_per_second())
        return self._default_bytes

    def plan(self, buckets: list[GradientBucket]) -> BucketTransport:
        if not self._hosts.slices_cross_hosts:
            return SharedMemoryBuckets(self._control, self._hosts, fallback=self._fallback).plan(buckets)
        engine = self._hosts.shared_memory
        placed = _into_shared_memory(engine, buckets, homes=True)
        if placed is None:
            return self._fallback().plan(buckets)
        if engine.signals is None:  # known once the first file exists, alike on every worker (agreed)
            for bucket in buckets:  # homes are summed as slices cross hosts: slots and a result instead
                bucket.home, bucket.undivided = None, False
            placed = _into_shared_memory(engine, buckets)
            if placed is None:
                return self._fallback().plan(buckets)
            return SharedMemoryBuckets(self._control, self._hosts, fallback=self._fallback).adopt(placed)
        self._placed, self._launched, self._started = placed, [], 0
        return self

    def leave_home(self, bucket: GradientBucket) -> None:
        _leave_home(self._placed[id(bucket)], bucket, self._hosts.shared_memory.rank)

    def launch(self, bucket: GradientBucket, divisor: int) -> None:
        placed = self._placed[id(bucket)]
        if placed.homes is not None:
            _summed_as(placed.homes, bucket, divisor)
        bucket.work = self._hosts.announce(placed.written)
        self._launched.append(bucket)

    def poll(self) -> None:
        while self._started < len(self._launched):
            bucket = self._launched[self._started]
            if not bucket.work.is_completed():
                return
            self._start_across(bucket)

    def _start_across(self, bucket: GradientBucket) -> None:
        placed = self._placed[id(bucket)]
        engine = self._hosts.shared_memory
        if placed.homes is not None:
            summed = engine.sum_my_slice_in_first(placed.homes.in_use(), placed.homes.divisor)
        else:
            engine.sum_my_slice(placed.segment)
            summed = engine.my_part(placed.segment.result)
        placed.across = self._hosts.start_across_hosts(summed)
        self._started += 1

    def finish(self, buckets: list[GradientBucket]) -> None:
        self.started_during_backward = self._started
        placed = [self._placed[id(bucket)] for bucket in buckets]
        try:
            for bucket in buckets[self._started:]:
                self._control.wait(bucket.work, OPERATION)
                self._start_across(bucket)
            self._hosts.wait_across_hosts([work for one in placed for work in one.across])
            engine = self._hosts.shared_memory
            for one in placed:
                if one.homes is not None:  # this worker's slice holds every host's sums: into every home
                    engine.spread_my_slice(one.homes.in_use())
            self._hosts.sync_host()
        finally:
            self._launched, self._started = [], 0
            for one in placed:
                one.across = []

    def sums(self, bucket: GradientBucket) -> torch.Tensor:
        return self._placed[id(bucket)].sums

    def sum_views(self, bucket: GradientBucket) -> list[torch.Tensor]:
        return self._placed[id(bucket)].results
