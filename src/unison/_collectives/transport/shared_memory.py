"""All-reduce through shared memory, for CPU workers that share one host.

gloo moves every byte of a CPU all-reduce through loopback TCP, several times over and
on its own threads. Workers on one host can instead meet in one shared-memory file:
each writes its tensors into its own slot, sums one slice of every worker's slot into
the result slot, and copies the result out. Two tiny gloo all-reduces order these steps
and carry the timeout and peer-loss detection of every other collective. This beats
gloo's all-reduce of the same bytes, flat or packed (``benchmarks/RESULTS.md``,
'Shared-memory all-reduce against gloo').

The files live in ``/dev/shm``. Worker 0 creates each one with its size but no pages,
every worker maps it, and worker 0 unlinks it once all have: the memory is freed when
the last worker unmaps it or exits, crash included. Only then does worker 0 reserve the
pages (``posix_fallocate``, so a full tmpfs is a clean error on every worker, not a
SIGBUS later): that is slow for large files, and doing it first kept the file's name in
``/dev/shm`` that long, where a worker 0 killed meanwhile left it behind
(``benchmarks/RESULTS.md``, 'Reserving shared memory after the unlink'). Whether the
workers share a host is found by that first mapping: a worker on another host (or with
another ``/dev/shm``) cannot open the file, and then every worker falls back to the
network collectives for good.
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
import time
from collections.abc import Callable, Sequence

import torch

from unison._collectives.group.process_group import WorkerGroup
from unison._collectives.transport import shm_signals
from unison._collectives.transport.flat_buffers import BufferPool, dtype_groups, fill, views_of
from unison._collectives.transport.shm_signals import SharedSignals

__all__ = ["SharedMemoryAllReduce", "SharedSegment", "SHARED_MEMORY_DIR", "MAX_SEGMENTS", "MAX_IDLE_CALLS"]

logger = logging.getLogger(__name__)

SHARED_MEMORY_DIR = "/dev/shm"
MAX_SEGMENTS = 8
"""Mapped files kept for reuse, least recently used dropped first (one per dtype and size)."""
MAX_IDLE_CALLS = 64
"""A file no call used for this many calls is dropped: a one-off large batch does not pin its memory."""
ORPHAN_AGE_S = 60.0
"""A file of a dead creator this old is an orphan (live ones are unlinked within milliseconds, whatever their size)."""


class SharedSegment:
    """One shared file: ``world_size`` input slots and one result slot of ``numel`` elements.

    ``handed_out``: where asked (``new_segment(..., handed_out=True)``), a second mapping of
    the same file, for the memory handed out to gradients. Its storage is held only by what
    was handed out and whoever kept some of it, so counting its holders tells a gradient a
    user kept; the transport's own views (a slice a collective's thread still holds after its
    wait returned) are on ``storage`` and never count.
    """

    def __init__(self, storage: torch.Tensor, world_size: int, numel: int, handed_out: torch.Tensor | None = None):
        self.storage = storage
        self.handed_out = handed_out
        self.inputs = [storage[r * numel:(r + 1) * numel] for r in range(world_size)]
        self.result = storage[world_size * numel:]


def _check_exact(name: str, divisor: int) -> None:
    """Refuses a divisor that scaling each input while summing would not apply exactly."""
    if divisor < 1 or divisor & (divisor - 1):
        raise ValueError(f"{name}={divisor}: only 1 or a power of two is applied exactly while summing; "
                         "divide the slots first and pass 1")


def _add_in_order(terms: Sequence[tuple[torch.Tensor, float]], out: torch.Tensor) -> None:
    """``out = c0 * t0 + c1 * t1 + ...``, added in that order, each ``c`` a power of two (so each
    product is exact and the bits are those of the terms scaled first). ``out`` may be the first
    term, which is the only one written before all of them are read."""
    (first, c_first), *rest = terms
    if not rest:
        if c_first != 1.0:
            torch.mul(first, c_first, out=out)
        elif out.data_ptr() != first.data_ptr():
            out.copy_(first)
        return
    (second, c_second), *rest = rest
    if c_first == 1.0 and c_second == 1.0:
        torch.add(first, second, out=out)
    elif c_first == 1.0:
        torch.add(first, second, alpha=c_second, out=out)
    elif c_second == 1.0:
        torch.add(second, first, alpha=c_first, out=out)  # c_first * first + second: addition commutes
    else:
        torch.mul(first, c_first, out=out)
        out.add_(second, alpha=c_second)
    for term, c in rest:
        if c == 1.0:
            out.add_(term)
        else:
            out.add_(term, alpha=c)


class SharedMemoryAllReduce:
    """Sums (or averages) dense CPU tensors across the workers of one host through ``/dev/shm``.

    Every worker must make the same calls in the same order (as for any collective); the
    segment cache then evolves identically everywhere, so all workers agree on when a new
    file is created or an idle one dropped without saying so. The cache changes only once
    the layout check has passed, so a mismatch (raised on every worker) leaves it equal.

    Args:
        rank, world_size: this worker's place in the group (the workers of its host).
        barrier: waits until every worker arrives (raises the group's PeerLostError).
        broadcast_ints: worker 0's list of ints, on every worker.
        agree_min: the smallest of every worker's int, on every worker (of every host, in a
            hierarchical all-reduce: they all share memory, or all fall back, together).
        after_sums: called on every worker once it summed its slice of every result,
            before the host's workers synchronise and copy the results out; the
            hierarchical transport adds the hosts' sums there.
        signal_group: the host's worker group (its timeout, task names and lost-peer
            errors). Given, the workers synchronise through counters in shared memory
            (``shm_signals``) where the platform allows, instead of ``barrier``; None:
            always ``barrier``.
    """

    def __init__(self, rank: int, world_size: int, barrier: Callable[[], None],
                 broadcast_ints: Callable[[list[int]], list[int]], agree_min: Callable[[int], int],
                 *, after_sums: Callable[[list[SharedSegment]], None] | None = None,
                 signal_group: Callable[[], WorkerGroup] | None = None):
        self._rank = rank
        self._signal_group = signal_group
        self.signals: SharedSignals | None = None  # made with the first shared file
        self._world_size = world_size
        self._after_sums = after_sums
        self._barrier = barrier
        self._broadcast_ints = broadcast_ints
        self._agree_min = agree_min
        self._segments: dict[tuple[torch.dtype, int], SharedSegment] = {}  # insertion order = least recent first
        self._last_used: dict[tuple[torch.dtype, int], int] = {}
        self._calls = 0
        self._pool = BufferPool()
        # One worker alone shares nothing, unless it is one host of a hierarchical all-reduce,
        # which runs the same steps on every host.
        self.available = world_size > 1 or after_sums is not None

    def eligible(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether these dense tensors go through shared memory (the same answer wherever the layout is the same)."""
        # Every size: faster than gloo at every size measured (benchmarks/RESULTS.md,
        # 'Shared-memory all-reduce against gloo'). Empty
        # batches stay off it (a file of 0 bytes cannot be reserved).
        return self.available and all(t.is_cpu for t in tensors) and sum(t.nbytes for t in tensors) > 0

    def __call__(self, tensors: Sequence[torch.Tensor], divisor: int = 1,
                 check: Callable[[], None] | None = None) -> list[torch.Tensor] | None:
        """The reduced tensors, in input order, as views of private pooled buffers.

        Args:
            tensors: ``eligible`` tensors; they are only read.
            divisor: every result is divided by it (MEAN); 1 leaves the sums.
            check: the layout check, a collective that every worker must pass first; it
                doubles as the barrier after the inputs are written. None: a plain barrier.

        Returns:
            None when the workers just found that they cannot share memory (``available``
            is then False on all of them); ``check`` has run by then.
        """
        self._calls += 1
        self._drop_idle()
        results: list[torch.Tensor] = list(tensors)
        groups, divide_after = [], []  # integer results: divided per tensor, like the packed path
        for dtype, members, sources in dtype_groups(tensors):
            if divisor != 1 and not (dtype.is_floating_point or dtype.is_complex):
                divide_after.extend(members)
            if any(t.numel() for t in sources):
                groups.append((dtype, members, sources))
            else:  # nothing to add up, and no file of 0 bytes: empty results
                for index, source in zip(members, sources):
                    results[index] = torch.empty_like(source, memory_format=torch.contiguous_format)
        keys = [(dtype, sum(t.numel() for t in sources)) for dtype, _, sources in groups]
        if all(key in self._segments for key in keys):
            segments = [self._segments[key] for key in keys]
            self._write(groups, segments)
            if check is not None:
                check()  # every input slot is written once every worker is past it
            else:
                self.sync("inputs written")
            for key in keys:  # only now: a failed check must leave every worker's cache as it was
                self._use(key)
        else:
            if check is not None:
                check()  # before any new file: the layouts, hence the sizes, agree
            segments = []
            for key in keys:
                segment = self._segments.get(key) or self._create(*key)
                if segment is None:
                    return None
                segments.append(self._use(key))
            self._write(groups, segments)
            self.sync("inputs written")
        for segment in segments:
            self.sum_my_slice(segment, divisor)
        if self._after_sums is not None:
            self._after_sums(segments)  # the hierarchical step: the sums, added across hosts
        self.sync("slices summed")  # every slice of the result is final
        for slot, ((dtype, members, sources), segment) in enumerate(zip(groups, segments)):
            private = self._pool.take(segment.result.numel(), dtype, torch.device("cpu"), slot)
            private.copy_(segment.result)
            for index, view in zip(members, views_of(private, sources)):
                results[index] = view
        self._pool.end_call()
        for index in divide_after:
            results[index] = results[index] / divisor
        return results

    def sync(self, operation: str) -> None:
        """A barrier of the host's workers: through the shared counters when there are any, else ``barrier``."""
        signals = self.signals
        if signals is None:
            self._barrier()
            return
        try:
            signals.barrier()
        except RuntimeError as exc:
            raise self.lost_peer_error(operation, exc) from exc

    def lost_peer_error(self, operation: str, cause: BaseException) -> Exception:
        """The host group's error for a failed shared-memory wait (naming the lost task)."""
        assert self._signal_group is not None
        return self._signal_group().lost_peer_error(f"shared-memory all-reduce ({operation})", cause)

    def _write(self, groups: list, segments: list[SharedSegment]) -> None:
        for (_, _, sources), segment in zip(groups, segments):
            fill(segment.inputs[self._rank], sources)

    @property
    def rank(self) -> int:
        """This worker's place among the host's workers."""
        return self._rank

    @property
    def world_size(self) -> int:
        """How many workers share the host's files."""
        return self._world_size

    def my_slot(self, segment: SharedSegment) -> torch.Tensor:
        """This worker's input slot of ``segment``."""
        return segment.inputs[self._rank]

    def my_slice(self, numel: int) -> tuple[int, int]:
        """The ``[start, end)`` of a result of ``numel`` elements this worker sums."""
        return numel * self._rank // self._world_size, numel * (self._rank + 1) // self._world_size

    def my_part(self, tensor: torch.Tensor) -> torch.Tensor:
        """The view of ``tensor`` (a flat result or slot) that this worker sums: ``my_slice`` of it."""
        start, end = self.my_slice(tensor.numel())
        return tensor[start:end]

    def sum_my_slice(self, segment: SharedSegment, divisor: int = 1) -> None:
        """Sums this worker's slice of every worker's input slot into the result slot (then divides).

        Every worker must have written its input slot (a barrier) before, and reads the
        result only after every worker has summed its slice (another barrier).
        """
        start, end = self.my_slice(segment.result.numel())
        if start == end:
            return
        out = segment.result[start:end]
        # Worker order, so every element is summed the same way whoever owns it.
        if self._world_size == 1:
            out.copy_(segment.inputs[0][start:end])
        else:
            torch.add(segment.inputs[0][start:end], segment.inputs[1][start:end], out=out)
        for inputs in segment.inputs[2:]:
            out.add_(inputs[start:end])
        if divisor != 1 and (out.is_floating_point() or out.is_complex()):
            out.div_(divisor)

    def sum_my_slice_into(self, slots: Sequence[torch.Tensor], divisor: int = 1,
                          own: Sequence[tuple[int, int, torch.Tensor]] = (), own_divisor: int = 1) -> None:
        """Sums this worker's slice of ``slots`` (one per worker, in worker order, all of one
        size), divided, back into every one of them.

        For gradients that live in their worker's slot: each worker finds the sums in its own
        slot, with no copy out of a result. ``divisor`` must be 1 or a power of two: each
        input is scaled by ``1 / divisor`` (exact) as it is added, in worker order, which gives
        the bits of :meth:`sum_my_slice` over inputs divided first. (Divide the slots first
        for another divisor.) Barriers as for :meth:`sum_my_slice`.

        ``own``: ``(start, end, tensor)`` pieces of this worker's slice, in order, whose input is
        ``tensor`` (its own gradients, not yet divided by ``own_divisor``, a power of two)
        instead of its slot, which the caller left unwritten there (no piece may share memory
        with the slots): a worker need not copy into the file the part of its gradients that
        only it reads.
        """
        _check_exact("divisor", divisor)
        _check_exact("own_divisor", own_divisor)
        start, end = self.my_slice(slots[0].numel())
        scale = 1.0 / divisor
        at = start
        for lo, hi, tensor in own:
            if not start <= at <= lo < hi <= end or tensor.numel() != hi - lo:
                raise ValueError(f"own: the piece [{lo}, {hi}) of {tensor.numel()} elements is not in order "
                                 f"within this worker's slice [{start}, {end})")
            self._sum_range(slots, at, lo, scale)
            self._sum_range(slots, lo, hi, scale, (tensor.view(-1), scale / own_divisor))
            at = hi
        self._sum_range(slots, at, end, scale)

    def sum_my_slice_in_first(self, slots: Sequence[torch.Tensor], divisor: int = 1) -> torch.Tensor:
        """Sums this worker's slice of ``slots`` (one per worker, in worker order, all of one size)
        into the first slot's slice, each input scaled by ``1 / divisor`` (1 or a power of two) as it
        is added, as :meth:`sum_my_slice_into` does; returns that slice, a view of the first slot.

        The first half of :meth:`sum_my_slice_into`, for sums that are not final yet: the
        hierarchical transport adds the hosts' sums to the returned slice in place, then
        :meth:`spread_my_slice` copies it into the other slots. Only this worker reads or
        writes its slice of any slot in between. Barriers as for :meth:`sum_my_slice`.
        """
        _check_exact("divisor", divisor)
        start, end = self.my_slice(slots[0].numel())
        out = slots[0][start:end]
        if start < end:
            _add_in_order([(slot[start:end], 1.0 / divisor) for slot in slots], out)
        return out

    def spread_my_slice(self, slots: Sequence[torch.Tensor]) -> None:
        """Copies this worker's slice of the first of ``slots`` into every other one (after
        :meth:`sum_my_slice_in_first` and whatever was added to its slice since)."""
        start, end = self.my_slice(slots[0].numel())
        if start < end:
            for slot in slots[1:]:
                slot[start:end].copy_(slots[0][start:end])

    def _sum_range(self, slots: Sequence[torch.Tensor], lo: int, hi: int, scale: float,
                   mine: tuple[torch.Tensor, float] | None = None) -> None:
        """``[lo, hi)`` of every slot, each scaled by ``scale`` as it is added in worker order, summed
        and copied into every slot. ``mine``: this worker's input and its scale, instead of its
        slot's, which then holds nothing to read: the sum is made there. Else it is made in the
        first worker's slot (the first input: the only one each step may overwrite before it is read)."""
        if lo == hi:
            return
        me = self._rank
        terms = [(slot[lo:hi], scale) for slot in slots]
        into = 0
        if mine is not None:
            terms[me], into = mine, me
        out = terms[into][0] if mine is None else slots[me][lo:hi]
        _add_in_order(terms, out)
        for rank, slot in enumerate(slots):
            if rank != into:
                slot[lo:hi].copy_(out)

    def _use(self, key: tuple[torch.dtype, int]) -> SharedSegment:
        segment = self._segments.pop(key)
        self._segments[key] = segment  # most recent last
        self._last_used[key] = self._calls
        return segment

    def _drop_idle(self) -> None:
        """Unmaps files idle for MAX_IDLE_CALLS calls (the same on every worker: calls are collective)."""
        for key in [k for k, last in self._last_used.items() if self._calls - last > MAX_IDLE_CALLS]:
            self._segments.pop(key, None)
            del self._last_used[key]

    def _create(self, dtype: torch.dtype, numel: int) -> SharedSegment | None:
        """A new cached segment (a collective), or None when the workers cannot share memory."""
        if len(self._segments) >= MAX_SEGMENTS:
            oldest = next(iter(self._segments))
            del self._segments[oldest]
            self._last_used.pop(oldest, None)
        segment = self.new_segment(dtype, numel)
        if segment is not None:
            self._segments[(dtype, numel)] = segment
        return segment

    def _make_signals(self) -> None:
        """After the first shared file: the counters the workers synchronise on (a collective).

        Every worker of every host takes part in the agreement, so all use the counters or
        none does (the hierarchical transport's hosts make the same calls in the same order).
        """
        if self._signal_group is None or self.signals is not None:
            return
        if not self._agree_min(1 if shm_signals.supported() else 0):
            self._signal_group = None  # not on every host: gloo barriers for good
            return
        group, self._signal_group = self._signal_group, None  # no recursion from new_segment
        try:
            segment = self.new_segment(torch.int64, shm_signals.SLOTS_PER_WORKER)
        finally:
            self._signal_group = group
        if segment is None:
            return
        words = segment.storage[: self._world_size * shm_signals.SLOTS_PER_WORKER]
        formed = group()
        self.signals = shm_signals.make_signals(words, self._rank, self._world_size, formed.timeout,
                                                formed.names, self._barrier)

    def new_segment(self, dtype: torch.dtype, numel: int, handed_out: bool = False) -> SharedSegment | None:
        """Creates and maps one shared file on every worker (a collective), or finds it cannot.

        With ``handed_out``, each worker maps it twice (``SharedSegment.handed_out``).
        Returns None, with ``available`` then False on every worker, when they cannot.
        Worker 0 creates the file only once every worker has arrived, and unlinks it
        whatever happens next, before reserving its memory; so a file outlives the call
        only if worker 0 is killed in the milliseconds between (one broadcast, the
        mappings and one agreement, whatever the size); the next creation on this host
        removes such orphans.
        """
        elements = (self._world_size + 1) * numel
        size = elements * dtype.itemsize
        self._barrier()
        token, reason, created, descriptor, everyone = 0, "", None, None, 0
        try:
            if self._rank == 0:
                _remove_orphans()
                token = secrets.randbits(62) | 1  # never 0, which says 'failed'
                path = _path(token, os.getpid())
                try:
                    descriptor = _create_file(path, size)
                    created = path
                except OSError as exc:
                    reason = f"cannot create {size} bytes in {SHARED_MEMORY_DIR}: {exc}"
                    token = 0
            token, creator = self._broadcast_ints([token, os.getpid()])
            storage = second = None
            if not token and not reason:
                reason = "worker 0 could not create a shared file (its log says why)"
            if token:
                path = _path(token, creator)
                try:
                    storage = _map_file(path, size, elements, dtype)
                    if handed_out:
                        second = _map_file(path, size, elements, dtype)
                except (OSError, RuntimeError) as exc:
                    reason = f"worker {self._rank} cannot map {path}: {exc} (workers on different hosts?)"
            everyone = self._agree_min(1 if storage is not None else 0)
        finally:
            if created is not None:
                _unlink(created)  # every worker has it mapped, or has given up (or a peer is lost)
            if descriptor is not None and not everyone:  # failed, or a peer is lost: nothing to reserve
                os.close(descriptor)
                descriptor = None
        memory_failed = not token
        if everyone:
            # Only now, with the file unlinked, reserve its memory: the slow part (see
            # benchmarks/RESULTS.md, 'Reserving shared memory after the unlink') no
            # longer keeps the file's name alive, and a full /dev/shm is still
            # a clean error on every worker instead of a SIGBUS at first touch.
            reserved = 1
            if descriptor is not None:
                try:
                    _reserve(descriptor, size)
                except OSError as exc:
                    reason, reserved = f"cannot create {size} bytes in {SHARED_MEMORY_DIR}: {exc}", 0
                finally:
                    os.close(descriptor)
            everyone = self._agree_min(reserved)
            if not everyone:
                memory_failed = True
                reason = reason or "worker 0 could not create a shared file (its log says why)"
        if not everyone:
            self.available = False
            self._segments.clear()
            self._last_used.clear()
            # Workers on several hosts are a normal cluster (info); a host that cannot give
            # the memory (full /dev/shm, no posix_fallocate) is worth a warning.
            logger.log(logging.WARNING if memory_failed else logging.INFO,
                       "unison: no shared memory between the workers, all-reduces go over the network "
                       "collective: %s", reason or "another worker cannot map the shared file (its log says why)")
            return None
        assert storage is not None
        segment = SharedSegment(storage, self._world_size, numel, second)
        self._make_signals()
        return segment if self.available else None  # the counters' file failed: everyone gave up


def _create_file(path: str, size: int) -> int:
    """Creates ``path`` of ``size`` bytes, none reserved yet; returns its open descriptor.

    Setting the size is instant (the file is sparse), so the file's name exists only
    for as long as the workers take to open it; ``_reserve`` does the slow part later.

    Raises:
        OSError: and leaves nothing behind.
    """
    if not hasattr(os, "posix_fallocate"):  # macOS, Windows: no way to reserve the pages up front
        raise OSError(f"os.posix_fallocate does not exist on {sys.platform}")
    descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(descriptor, size)
    except OSError:
        os.close(descriptor)
        _unlink(path)
        raise
    return descriptor


def _reserve(descriptor: int, size: int) -> None:
    """Reserves every page of the (unlinked) file, so a full tmpfs raises OSError now."""
    os.posix_fallocate(descriptor, 0, size)


def _map_file(path: str, size: int, elements: int, dtype: torch.dtype) -> torch.Tensor:
    """Maps worker 0's file; raises OSError if it is not there (another host) or not its size."""
    descriptor = os.open(path, os.O_RDWR)  # no O_CREAT: another host's worker fails here
    try:
        found = os.fstat(descriptor).st_size
    finally:
        os.close(descriptor)
    if found != size:
        raise OSError(f"{path} has {found} bytes, expected {size}")
    return torch.from_file(path, shared=True, size=elements, dtype=dtype)


def _path(token: int, creator: int) -> str:
    """The file of ``token``; its name carries the creating process's pid, to find orphans."""
    return os.path.join(SHARED_MEMORY_DIR, f"unison-{creator}-{token:016x}")


def _remove_orphans(now: float | None = None) -> None:
    """Deletes files left by a worker 0 killed between creating and unlinking one.

    Such a file is older than ``ORPHAN_AGE_S`` and its creator's pid is gone. The age
    spares a live job in another pid namespace that shares ``/dev/shm``: its files live
    for milliseconds.
    """
    try:
        names = os.listdir(SHARED_MEMORY_DIR)
    except OSError:
        return
    now = time.time() if now is None else now
    for name in names:
        parts = name.split("-")
        if len(parts) != 3 or parts[0] != "unison" or not parts[1].isdigit():
            continue
        path = os.path.join(SHARED_MEMORY_DIR, name)
        try:
            if now - os.stat(path).st_mtime < ORPHAN_AGE_S:
                continue
            os.kill(int(parts[1]), 0)
        except ProcessLookupError:
            _unlink(path)
        except OSError:
            pass  # gone already, or alive under another user: not ours


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
