"""Each bucket transport alone, against a plain sum (``_collectives/transport/bucket_transports.py``).

Two warm pool workers build the transport their strategy's options choose, hand it
buckets of known values (this worker's gradients already divided, then one flag per
parameter, as the gradient synchroniser fills them) and read the sums back.
"""

from __future__ import annotations

import pytest
import torch

import unison
from unison._collectives.transport.bucket_transports import (
    AllReduceBuckets,
    CompressedBuckets,
    GradientBucket,
    HandOut,
    PowerSGDBuckets,
)
from unison._collectives.transport.flat_buffers import views_of
from unison._collectives.transport.shared_buckets import SharedMemoryBuckets

pytestmark = pytest.mark.timeout(60)

ADDRESSES = ["127.0.0.1:1", "127.0.0.1:2"]  # never bound: the pool's gloo group is reused
SHAPES = [[(3, 4), (5,)], [(2, 2, 2), (7,), (1,)]]  # two buckets


def _gradients(rank: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    return [[torch.randn(shape, generator=g) for shape in bucket] for bucket in SHAPES]


def _expected(world: int, divisor: int) -> list[list[torch.Tensor]]:
    per_rank = [_gradients(r) for r in range(world)]
    return [[sum(per_rank[r][b][k] for r in range(world)) / divisor for k in range(len(SHAPES[b]))]
            for b in range(len(SHAPES))]


def _move(rank: int, world: int, options: dict, missing: tuple[int, int] | None = None):
    """This worker's buckets through its transport; the sums and flags' sums per bucket."""
    resolver = unison.SimpleClusterResolver(unison.ClusterSpec({"worker": ADDRESSES[:world]}),
                                            task_type="worker", task_id=rank)
    strategy = unison.MultiWorkerMirroredStrategy(resolver, unison.CommunicationOptions(**options))
    transport = strategy.extended.cross_device_ops.transport.bucket_transport()
    divisor = world
    buckets = []
    for grads in _gradients(rank):
        params = [torch.zeros(g.shape, requires_grad=True) for g in grads]
        size = sum(g.numel() for g in grads)
        flat = torch.zeros(size + len(grads))
        buckets.append(GradientBucket(params, views_of(flat[:size], params), flat))
    carrier = transport.plan(buckets)
    read: list[torch.Tensor] = []  # the gradients a transport that reads them reduces in place
    for bucket, grads in zip(buckets, _gradients(rank)):
        if carrier.reads_gradients:
            bucket.grads = [g.clone() for g in grads]
            read += bucket.grads
        else:
            for view, grad in zip(bucket.views, grads):
                view.copy_(grad / divisor)
            bucket.used.fill_(1)
            if missing is not None and missing[0] == rank:
                bucket.used[missing[1]] = 0
        carrier.launch(bucket, divisor)
        carrier.poll()
    carrier.finish(buckets)
    if carrier.hand_out is HandOut.IN_PLACE:
        return {"carrier": type(carrier).__name__, "in_place": True, "grads": read}
    out = []
    for bucket in buckets:
        reduced = carrier.sums(bucket)
        out.append({"sums": [v.clone() for v in views_of(reduced[:bucket.size], bucket.params)],
                    "flags": carrier.used_sums(bucket)})
    return {"carrier": type(carrier).__name__, "in_place": False, "buckets": out,
            "overlaps": carrier.overlaps_backward, "hand_out": carrier.hand_out.value}


@pytest.mark.parametrize("options,carrier,overlaps,tolerance", [
    ({"implementation": "RING"}, AllReduceBuckets, True, 1e-6),
    ({"implementation": "AUTO"}, SharedMemoryBuckets, False, 1e-6),
    ({"compression": "bf16"}, CompressedBuckets, True, 2e-2),
    ({"compression": "fp16"}, CompressedBuckets, True, 2e-3),
], ids=["all_reduce", "shared_memory", "bf16", "fp16"])
def test_a_bucket_transport_sums_buckets_and_flags_as_a_plain_sum(worker_pool, options, carrier, overlaps, tolerance):
    results = worker_pool.run(_move, options, (1, 0), timeout=40)
    want = _expected(2, 2)
    for result in results:
        assert result["carrier"] == carrier.__name__
        assert result["overlaps"] is overlaps
        for b, bucket in enumerate(result["buckets"]):
            for got, expected in zip(bucket["sums"], want[b], strict=True):
                torch.testing.assert_close(got, expected, rtol=0, atol=tolerance)
            # worker 1 said it has no gradient for the first parameter: one flag less there
            assert bucket["flags"] == [1.0] + [2.0] * (len(SHAPES[b]) - 1)
    assert torch.equal(results[0]["buckets"][0]["sums"][0], results[1]["buckets"][0]["sums"][0])


def _overflowing(rank: int, world: int):
    """float16 buckets whose sum overflows: travel exactly again, on both workers alike."""
    resolver = unison.SimpleClusterResolver(unison.ClusterSpec({"worker": ADDRESSES[:world]}),
                                            task_type="worker", task_id=rank)
    strategy = unison.MultiWorkerMirroredStrategy(resolver, unison.CommunicationOptions(compression="fp16"))
    carrier = strategy.extended.cross_device_ops.transport.bucket_transport().plan([])
    param = torch.zeros(4, requires_grad=True)
    flat = torch.tensor([60000.0, 1.0, -60000.0, 0.5, 1.0])
    bucket = GradientBucket([param], views_of(flat[:4], [param]), flat)
    carrier.launch(bucket, 1)
    carrier.finish([bucket])
    return carrier.sums(bucket)


def test_compressed_buckets_whose_half_sum_overflows_travel_exactly(worker_pool):
    for sums in worker_pool.run(_overflowing, timeout=40):
        assert torch.equal(sums, torch.tensor([120000.0, 2.0, -120000.0, 1.0, 2.0]))


def test_powersgd_buckets_reduce_the_gradients_themselves(worker_pool):
    """Before ``start_iter`` PowerSGD sums exactly; it reads and reduces the gradients in place."""
    options = {"compression": unison.PowerSGD(rank=1, start_iter=10)}
    results = worker_pool.run(_move, options, timeout=40)
    want = [g for bucket in _expected(2, 2) for g in bucket]
    for result in results:
        assert result["carrier"] == PowerSGDBuckets.__name__ and result["in_place"]
        for got, expected in zip(result["grads"], want, strict=True):
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)

