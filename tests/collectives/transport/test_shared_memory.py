"""Shared-memory all-reduce pieces that need no second process: orphans and failure cleanup."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from unison._collectives.transport import shared_memory
from unison.errors import PeerLostError


@pytest.fixture
def shm_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(shared_memory, "SHARED_MEMORY_DIR", str(tmp_path))
    return tmp_path


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _touch(directory, name: str, age_s: float) -> None:
    path = directory / name
    path.write_bytes(b"x")
    then = time.time() - age_s
    os.utime(path, (then, then))


def test_orphans_of_dead_creators_are_removed_once_old(shm_dir):
    dead, alive = _dead_pid(), os.getpid()
    old = shared_memory.ORPHAN_AGE_S + 5
    _touch(shm_dir, f"unison-{dead}-00000000000000aa", old)  # orphan
    _touch(shm_dir, f"unison-{dead}-00000000000000bb", 1.0)  # too young: maybe a live job elsewhere
    _touch(shm_dir, f"unison-{alive}-00000000000000cc", old)  # creator alive
    _touch(shm_dir, "unison-notapid-00000000000000dd", old)  # not ours
    _touch(shm_dir, "other-file", old)
    shared_memory._remove_orphans()
    assert sorted(p.name for p in shm_dir.iterdir()) == sorted([
        f"unison-{dead}-00000000000000bb", f"unison-{alive}-00000000000000cc",
        "unison-notapid-00000000000000dd", "other-file"])


def test_worker_0_unlinks_its_file_when_a_peer_is_lost_during_setup(shm_dir):
    def lost(values):
        raise PeerLostError("broadcast failed: missing task(s): worker:1")

    transport = shared_memory.SharedMemoryAllReduce(0, 2, barrier=lambda: None, broadcast_ints=lost,
                                                    agree_min=lambda value: value)
    with pytest.raises(PeerLostError, match="worker:1"):
        transport([torch.ones(10)])
    assert list(shm_dir.iterdir()) == []


def test_a_full_shared_memory_leaves_no_file_and_falls_back(shm_dir, monkeypatch, caplog):
    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shared_memory.os, "posix_fallocate", full)
    transport = shared_memory.SharedMemoryAllReduce(0, 2, barrier=lambda: None, broadcast_ints=lambda v: v,
                                                    agree_min=lambda value: value)
    assert transport([torch.ones(10)]) is None
    assert transport.available is False
    assert list(shm_dir.iterdir()) == []
    assert "No space left on device" in caplog.text


def test_a_handed_out_mapping_is_the_same_memory_on_a_storage_of_its_own(shm_dir):
    """``new_segment(handed_out=True)`` maps the file twice: a write through either mapping is
    read through the other, and holding a view of the transport's mapping (a collective's
    thread that has not dropped its work yet) leaves the handed-out storage's holders as they
    were, so counting them tells only what was handed out."""
    from unison._interpose.torch_private import storage_use_count

    engine = shared_memory.SharedMemoryAllReduce(0, 2, barrier=lambda: None, broadcast_ints=lambda v: v,
                                                 agree_min=lambda value: value)
    segment = engine.new_segment(torch.float32, 8, handed_out=True)
    assert segment is not None and segment.handed_out is not None
    assert list(shm_dir.iterdir()) == []  # unlinked once mapped, both times
    mine = segment.handed_out[:8]
    holders = storage_use_count(mine)
    summed = segment.storage[2:6]  # the transport's view of the same elements
    summed.fill_(3.0)
    assert mine[2:6].tolist() == [3.0] * 4
    mine[6:8] = 5.0
    assert segment.storage[6:8].tolist() == [5.0, 5.0]
    assert storage_use_count(mine) == holders
    assert engine.new_segment(torch.float32, 8).handed_out is None  # only where asked


def test_a_single_worker_never_uses_shared_memory():
    transport = shared_memory.SharedMemoryAllReduce(0, 1, barrier=lambda: None, broadcast_ints=lambda v: v,
                                                    agree_min=lambda value: value)
    assert not transport.eligible([torch.ones(10)])


def test_empty_and_non_cpu_batches_are_not_eligible():
    transport = shared_memory.SharedMemoryAllReduce(0, 2, barrier=lambda: None, broadcast_ints=lambda v: v,
                                                    agree_min=lambda value: value)
    assert transport.eligible([torch.ones(3)])
    assert not transport.eligible([])
    assert not transport.eligible([torch.ones(0)])
    assert not transport.eligible([torch.ones(3, device="meta")])


@settings(max_examples=30)
@given(world=st.integers(2, 5), numel=st.integers(1, 40), scale_by=st.sampled_from(["one", "world"]),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
def test_summing_every_slice_into_the_slots_gives_the_bits_of_dividing_first(world, numel, scale_by, dtype):
    """Every owner's slice summed back into every slot, in worker order, scaled as added:
    each slot ends with the bits of the inputs divided first and added in worker order (a
    power-of-two divisor), or added as they are; another divisor is refused."""
    inputs = [_tensor((numel,), dtype, 31 * rank) for rank in range(world)]
    divisor = world if scale_by == "world" and world & (world - 1) == 0 else 1
    expected = inputs[0] / divisor
    for part in inputs[1:]:
        expected = expected + part / divisor
    slots = [t.clone() for t in inputs]
    for rank in range(world):  # each owner in turn (in the file they run at once, on disjoint slices)
        engine = shared_memory.SharedMemoryAllReduce(rank, world, barrier=lambda: None, broadcast_ints=lambda v: v,
                                                     agree_min=lambda value: value)
        engine.sum_my_slice_into(slots, divisor)
    for slot in slots:
        assert torch.equal(slot, expected)
    if world & (world - 1):
        with pytest.raises(ValueError, match=f"divisor={world}"):
            engine.sum_my_slice_into(slots, world)


@settings(max_examples=30)
@given(world=st.integers(2, 5), numel=st.integers(1, 40), scale_by=st.sampled_from(["one", "world"]),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
def test_slices_summed_into_the_first_slot_then_spread_give_every_slot_the_same_bits(world, numel, scale_by, dtype):
    """The hierarchical transport's halves of ``sum_my_slice_into``: each owner sums its slice into
    the first slot (what then crosses hosts, here another host's sums added in place), and once
    that is final spreads it into the other slots: every slot ends with the same bits as summing
    in worker order, scaled as added, plus what was added to the slice; another divisor is refused."""
    inputs = [_tensor((numel,), dtype, 31 * rank) for rank in range(world)]
    other_host = _tensor((numel,), dtype, 997)
    divisor = world if scale_by == "world" and world & (world - 1) == 0 else 1
    expected = inputs[0] / divisor
    for part in inputs[1:]:
        expected = expected + part / divisor
    expected = expected + other_host
    slots = [t.clone() for t in inputs]
    engines = [shared_memory.SharedMemoryAllReduce(rank, world, barrier=lambda: None, broadcast_ints=lambda v: v,
                                                   agree_min=lambda value: value) for rank in range(world)]
    for engine in engines:  # in the file the owners run at once, on disjoint slices
        start, end = engine.my_slice(numel)
        summed = engine.sum_my_slice_in_first(slots, divisor)
        assert summed.numel() == end - start and (end == start or summed.data_ptr() == slots[0][start:].data_ptr())
        summed.add_(other_host[start:end])  # the trip between hosts, in place
    for engine in engines:
        engine.spread_my_slice(slots)
    for slot in slots:
        assert torch.equal(slot, expected)
    if world & (world - 1):
        with pytest.raises(ValueError, match=f"divisor={world}"):
            engines[0].sum_my_slice_in_first(slots, world)


@settings(max_examples=40)
@given(world=st.integers(2, 5), numel=st.integers(1, 40), dtype=st.sampled_from([torch.float32, torch.float64,
                                                                                 torch.bfloat16]),
       own_divisor=st.sampled_from([1, 2, 4]), data=st.data())
def test_a_slice_read_from_the_owners_own_gradients_gives_the_bits_of_filling_them_first(world, numel, dtype,
                                                                                       own_divisor, data):
    """Pieces of an owner's slice taken from its own gradients (undivided; its slot left unwritten
    there) give the bits of those gradients divided into its slot first, everywhere."""
    inputs = [_tensor((numel,), dtype, 31 * rank) for rank in range(world)]
    expected = inputs[0] / own_divisor
    for part in inputs[1:]:
        expected = expected + part / own_divisor
    slots = [t / own_divisor for t in inputs]  # what the fill writes
    engines = [shared_memory.SharedMemoryAllReduce(rank, world, barrier=lambda: None, broadcast_ints=lambda v: v,
                                                   agree_min=lambda value: value) for rank in range(world)]
    owns = []
    for rank, engine in enumerate(engines):
        start, end = engine.my_slice(numel)
        cuts = sorted(data.draw(st.lists(st.integers(start, end), min_size=0, max_size=4), label=f"cuts {rank}"))
        pieces = [(lo, hi) for lo, hi in zip(cuts[::2], cuts[1::2]) if lo < hi]
        for lo, hi in pieces:
            slots[rank][lo:hi] = float("nan")  # left unwritten: never read
        owns.append([(lo, hi, inputs[rank][lo:hi].clone()) for lo, hi in pieces])
    for rank, engine in enumerate(engines):  # each owner in turn (at once, on disjoint slices, in the file)
        engine.sum_my_slice_into(slots, 1, own=owns[rank], own_divisor=own_divisor)
    for slot in slots:
        assert torch.equal(slot, expected)


def test_own_pieces_out_of_order_or_outside_the_slice_are_refused():
    engine = shared_memory.SharedMemoryAllReduce(1, 2, barrier=lambda: None, broadcast_ints=lambda v: v,
                                                 agree_min=lambda value: value)
    slots = [torch.zeros(10), torch.zeros(10)]  # worker 1 sums [5, 10)
    for own in ([(2, 6, torch.ones(4))], [(7, 9, torch.ones(2)), (5, 6, torch.ones(1))], [(5, 7, torch.ones(3))]):
        with pytest.raises(ValueError, match=r"own: the piece \[\d+, \d+\) of \d+ elements is not in order "
                                             r"within this worker's slice \[5, 10\)"):
            engine.sum_my_slice_into(slots, 1, own=own)
    with pytest.raises(ValueError, match="own_divisor=3"):
        engine.sum_my_slice_into(slots, 1, own=[], own_divisor=3)
    empty = shared_memory.SharedMemoryAllReduce(0, 2, barrier=lambda: None, broadcast_ints=lambda v: v,
                                                agree_min=lambda value: value)  # sums [0, 0) of one element
    with pytest.raises(ValueError, match=r"slice \[0, 0\)"):
        empty.sum_my_slice_into([torch.zeros(1), torch.zeros(1)], 1, own=[(0, 1, torch.ones(1))])


# -- the protocol, with workers as threads of this process ---------------------------------
class _ThreadWorkers:
    """The three collectives the transport needs, for ``world`` threads (a stand-in for gloo)."""

    def __init__(self, world: int):
        self._barrier = threading.Barrier(world, timeout=30)
        self._slots: list = [None] * world

    def barrier(self) -> None:
        self._barrier.wait()

    def _exchange(self, rank: int, value):
        self._slots[rank] = value
        self.barrier()
        seen = list(self._slots)
        self.barrier()
        return seen

    def transport(self, rank: int, world: int) -> shared_memory.SharedMemoryAllReduce:
        return shared_memory.SharedMemoryAllReduce(
            rank, world, self.barrier, lambda values: self._exchange(rank, values)[0],
            lambda value: min(self._exchange(rank, value)))


_DTYPES = [torch.float32, torch.float64, torch.int64]
_layouts = st.lists(st.tuples(st.lists(st.integers(0, 6), max_size=3), st.sampled_from(_DTYPES)),
                    min_size=1, max_size=6)


def _tensor(shape, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=dtype)
    return torch.randint(-50, 50, shape, generator=g, dtype=dtype)


@settings(max_examples=40)
@given(layout=_layouts, world=st.integers(2, 3), mean=st.booleans())
def test_threads_sum_any_layout_exactly_and_reuse_their_files(layout, world, mean):
    if sum(math.prod(shape) for shape, _ in layout) == 0:
        return  # not eligible: the caller keeps such batches on the network collective
    inputs = [[_tensor(shape, dtype, 97 * rank + i) for i, (shape, dtype) in enumerate(layout)]
              for rank in range(world)]
    originals = [[t.clone() for t in ts] for ts in inputs]
    expected = []
    for parts in zip(*inputs):
        total = parts[0].clone()
        for part in parts[1:]:
            total = total + part
        expected.append(total / world if mean else total)
    group = _ThreadWorkers(world)
    outcomes: list = [None] * world

    def work(rank: int) -> None:
        transport = group.transport(rank, world)
        first = transport(inputs[rank], divisor=world if mean else 1)
        second = transport(inputs[rank], divisor=world if mean else 1)  # the same files again
        outcomes[rank] = (first, second, len(transport._segments))

    threads = [threading.Thread(target=work, args=(rank,)) for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for rank in range(world):
        first, second, files = outcomes[rank]
        assert files == len({dtype for dtype in _DTYPES if sum(math.prod(s) for s, d in layout if d == dtype) > 0})
        for got in (first, second):
            for g, e in zip(got, expected):
                assert g.shape == e.shape and g.dtype == e.dtype
                assert torch.equal(g, e) if not mean else torch.allclose(g, e, rtol=0, atol=1e-6)
        assert all(torch.equal(t, o) for t, o in zip(inputs[rank], originals[rank]))


def test_worker_0_unlinks_the_file_before_reserving_its_memory(shm_dir, monkeypatch):
    """The slow step (0.2 s per 200 MB) runs on an unlinked file: a kill then leaves nothing."""
    seen = []
    reserve = os.posix_fallocate

    def recording(fd, offset, length):
        seen.append((os.readlink(f"/proc/self/fd/{fd}"), sorted(p.name for p in shm_dir.iterdir())))
        reserve(fd, offset, length)

    monkeypatch.setattr(shared_memory.os, "posix_fallocate", recording)
    transport = shared_memory.SharedMemoryAllReduce(0, 2, barrier=lambda: None, broadcast_ints=lambda v: v,
                                                    agree_min=lambda value: value)
    segment = transport.new_segment(torch.float32, 1000)
    assert segment is not None and segment.result.numel() == 1000
    ((target, names),) = seen
    assert target.endswith("(deleted)") and names == [], seen  # unlinked already, nothing by name
    segment.inputs[0].fill_(1)  # the mapping is usable, its pages reserved
    assert list(shm_dir.iterdir()) == []
