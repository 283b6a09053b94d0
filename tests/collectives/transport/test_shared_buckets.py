"""Shared-memory bucket transports: small buckets summed whole, from two slots in turn (``shared_buckets.py``).

Two warm pool workers move buckets through the transport of a one-host strategy for
several steps and read every step's sums back (the contract's checks against a plain sum
for every transport: ``test_bucket_transports.py``).
"""

from __future__ import annotations

import time

import pytest
import torch

import unison
from unison._collectives.transport import shared_buckets
from unison._collectives.transport.bucket_transports import GradientBucket
from unison._collectives.transport.flat_buffers import views_of
from unison._collectives.transport.shared_buckets import SharedMemoryBuckets

pytestmark = pytest.mark.timeout(60)

ADDRESSES = ["127.0.0.1:1", "127.0.0.1:2"]  # never bound: the pool's gloo group is reused


SMALL_AND_LARGE = [[(3, 4), (5,)], [(20_000,)]]  # 17 elements; 80 KB, above ONE_SHOT_BYTES
SMALL = [[(3, 4), (5,)], [(7,)]]


def _several_steps(rank: int, world: int, steps: int, shapes: list, lag: bool):
    """Buckets of ``shapes`` through the shared-memory transport for several steps. With
    ``lag``, worker 1 adds up each small bucket (summed whole, from two slots in turn) 50 ms
    late, so worker 0 has written its next step's gradients by then."""
    from unison._collectives.transport import shared_buckets

    add_up = shared_buckets._Halves.add_up
    if lag and rank == 1:
        add_up = shared_buckets._Halves.add_up

        def late_add_up(self):
            time.sleep(0.05)
            add_up(self)

        shared_buckets._Halves.add_up = late_add_up
    try:
        resolver = unison.SimpleClusterResolver(unison.ClusterSpec({"worker": ADDRESSES[:world]}),
                                                task_type="worker", task_id=rank)
        strategy = unison.MultiWorkerMirroredStrategy(resolver)
        transport = strategy.extended.cross_device_ops.transport.bucket_transport()
        buckets = []
        for bucket_shapes in shapes:
            params = [torch.zeros(shape, requires_grad=True) for shape in bucket_shapes]
            size = sum(p.numel() for p in params)
            flat = torch.zeros(size + len(params))
            buckets.append(GradientBucket(params, views_of(flat[:size], params), flat))
        carrier = transport.plan(buckets)
        summed_whole = [carrier._placed[id(bucket)].halves is not None for bucket in buckets]
        sums = []
        for step in range(steps):
            for b, bucket in enumerate(buckets):
                for k, view in enumerate(bucket.views):
                    view.fill_(1000.0 * step + 100.0 * b + 10.0 * k + rank)
                bucket.used.fill_(1)
                carrier.launch(bucket, world)
            carrier.finish(buckets)
            sums.append([[float(v.min()), float(v.max())] for bucket in buckets
                         for v in views_of(carrier.sums(bucket)[:bucket.size], bucket.params)]
                        + [carrier.used_sums(bucket) for bucket in buckets])
        return {"carrier": type(carrier).__name__, "summed_whole": summed_whole, "sums": sums}
    finally:
        shared_buckets._Halves.add_up = add_up


@pytest.mark.parametrize("shapes,lag,summed_whole", [
    (SMALL_AND_LARGE, False, [True, False]),
    (SMALL, True, [True, True]),
], ids=["small_and_large", "small_with_a_lagging_peer"])
def test_small_shared_buckets_are_summed_whole_from_two_slots_in_turn(worker_pool, shapes, lag, summed_whole):
    """A small bucket is summed whole by every worker (one wait a step), a large one in slices;
    every step's sums are right, also when a peer adds up late (a worker that wrote its next
    step into the slot a peer still reads would change that peer's sums)."""
    steps = 6
    results = worker_pool.run(_several_steps, steps, shapes, lag, timeout=40)
    for result in results:
        assert result["carrier"] == SharedMemoryBuckets.__name__
        assert result["summed_whole"] == summed_whole
        for step, got in enumerate(result["sums"]):
            values = [2 * (1000.0 * step + 100.0 * b + 10.0 * k) + 1 for b, k in ((0, 0), (0, 1), (1, 0))]
            assert got[:3] == [[v, v] for v in values], (step, got)
            assert got[3:] == [[2.0, 2.0], [2.0]]


HOME_SHAPES = [(100, 100), (7_000,)]  # 68 KB: above ONE_SHOT_BYTES, so summed in slices


def _homes_against_results(rank: int, world: int, divisors: list[int], leave_at: int):
    """A bucket of gradients living in their home undivided (``wants_slots``) beside the
    same gradients divided into a bucket of few gradients (also summed back into its home),
    step by step; worker 1 leaves the first bucket's home at step ``leave_at``, keeping a
    copy of what it held there."""
    resolver = unison.SimpleClusterResolver(unison.ClusterSpec({"worker": ADDRESSES[:world]}),
                                            task_type="worker", task_id=rank)
    strategy = unison.MultiWorkerMirroredStrategy(resolver)
    transport = strategy.extended.cross_device_ops.transport.bucket_transport()

    def bucket(wants_slots: bool) -> GradientBucket:
        params = [torch.zeros(shape, requires_grad=True) for shape in HOME_SHAPES]
        size = sum(p.numel() for p in params)
        flat = torch.zeros(size + len(params))
        return GradientBucket(params, views_of(flat[:size], params), flat, wants_slots=wants_slots)

    at_home, elsewhere = bucket(True), bucket(False)
    carrier = transport.plan([at_home, elsewhere])
    planned = {"undivided": at_home.home is not None and at_home.undivided,
               "divided": elsewhere.home is not None and not elsewhere.undivided}
    old_home, held = None, None
    steps = []
    for step, divisor in enumerate(divisors):
        if step == leave_at and rank == 1:
            old_home = at_home.home
            held = old_home.clone()
            carrier.leave_home(at_home)
        grads = torch.randn(at_home.size, generator=torch.Generator().manual_seed(100 * step + rank))
        at_home.flat[:at_home.size].copy_(grads)  # undivided: the transport divides
        torch.div(grads, divisor, out=elsewhere.flat[:elsewhere.size])  # divided, as the synchroniser fills
        for b in (at_home, elsewhere):
            b.used.fill_(1)
            carrier.launch(b, divisor)
        carrier.finish([at_home, elsewhere])
        sums = carrier.sums(at_home)
        steps.append({"home": sums.clone(), "elsewhere": carrier.sums(elsewhere).clone(),
                      "in_my_slot": sums.data_ptr() == at_home.flat.data_ptr()
                      and carrier.sums(elsewhere).data_ptr() == elsewhere.flat.data_ptr(),
                      "old_home_kept": None if old_home is None else torch.equal(old_home, held)})
    return {"planned": planned, "steps": steps, "size": at_home.size}


def test_gradients_at_home_get_the_sums_back_bit_for_bit_also_after_a_worker_leaves_its_home(worker_pool):
    """Each worker finds the sums in its own part of the file (no result to copy out), the
    very bits of gradients divided first and summed in worker order, for MEAN over two
    workers (divided while summed), a divisor that is no power of two (divided first) and
    SUM, whether the bucket took them undivided or divided; and after worker 1 left its home
    (a gradient held there), its sums come back into its spare and nothing writes its old
    home again."""
    divisors, leave_at = [2, 3, 1, 2, 2, 3], 3
    results = worker_pool.run(_homes_against_results, divisors, leave_at, timeout=40)
    size = results[0]["size"]
    for rank, result in enumerate(results):
        assert result["planned"] == {"undivided": True, "divided": True}
        for step, (got, divisor) in enumerate(zip(result["steps"], divisors, strict=True)):
            mine, theirs = (torch.randn(size, generator=torch.Generator().manual_seed(100 * step + r))
                            for r in (0, 1))
            expected = mine / divisor + theirs / divisor
            assert torch.equal(got["home"][:size], expected), (rank, step)
            assert torch.equal(got["home"][:size], got["elsewhere"][:size]), (rank, step)
            assert torch.equal(got["home"], results[1 - rank]["steps"][step]["home"]), (rank, step)
            assert bool((got["home"][size:] != 0).all()), (rank, step)  # every worker flagged every gradient
            assert got["in_my_slot"], (rank, step)
            assert got["old_home_kept"] is (None if rank == 0 or step < leave_at else True), (rank, step)


@pytest.mark.parametrize("numel,world", [(1, 2), (17, 2), (17_001, 2), (5, 3), (1_000, 4), (3, 8)])
def test_homes_spares_and_away_words_are_carved_apart_inside_the_file(numel, world):
    """Every worker's home and spare of ``numel`` elements and its ``away`` word: within the
    file ``new_segment`` makes for ``_home_file_elements``, none overlapping another. A
    worker's own home and spare are the same elements taken from the handed-out mapping."""
    from unison._collectives.transport.shared_memory import SharedSegment

    elements = shared_buckets._home_file_elements(numel, world)
    storage = torch.arange(float((world + 1) * elements))
    handed_out = storage.clone()  # stands for a second mapping: other storage, the same numbers
    for rank in range(world):
        homes = shared_buckets._carve_homes(SharedSegment(storage, world, elements, handed_out), numel, world, rank)
        for own, shared in [(homes.mine, homes.homes[rank]), (homes.my_spare, homes.spares[rank])]:
            assert own.untyped_storage().data_ptr() == handed_out.untyped_storage().data_ptr()
            assert own.storage_offset() == shared.storage_offset() and torch.equal(own, shared)
        regions = [*homes.homes, *homes.spares]
        assert [r.numel() for r in regions] == [numel] * 2 * world and homes.away.numel() == world
        taken = torch.cat([*regions, homes.away])
        assert taken.unique().numel() == taken.numel() == 2 * world * numel + world  # disjoint, all in the file
    assert (world + 1) * elements - (2 * world * numel + world) <= world  # little left unused


class _Link:
    """Hosts whose link a probe reads at ``rate`` bytes a second (counts the probes)."""

    slices_cross_hosts = True

    def __init__(self, rate: int):
        self.rate, self.probes = rate, 0

    def link_bytes_per_second(self) -> int:
        self.probes += 1
        return self.rate


@pytest.mark.parametrize("rate,expected", [
    (7_000_000, 512 * 1024),  # 100 Mbit/s, as the simulated hosts read it
    (23_000_000, 512 * 1024),  # 250 Mbit/s
    (40_000_000, 1024 * 1024),  # at the first rate
    (60_000_000, 1024 * 1024),  # 1 Gbit/s
    (125_000_000, shared_buckets.PIPELINED_BUCKET_BYTES),  # at the second
    (335_000_000, shared_buckets.PIPELINED_BUCKET_BYTES),  # an unlimited veth pair
], ids=["100mbit", "250mbit", "at-40MBps", "1gbit", "at-125MBps", "unlimited"])
def test_buckets_that_cross_hosts_are_smaller_on_a_slower_link_probed_once(rate, expected):
    hosts = _Link(rate)
    transport = shared_buckets.PipelinedHostBuckets(None, hosts)
    assert transport.default_bucket_bytes() == expected == shared_buckets.bucket_bytes_for_link(rate)
    assert transport.default_bucket_bytes() == expected  # the buckets rebuilt: no second probe
    assert hosts.probes == 1
