"""Which parameters ``BucketedGradientSync`` puts in which bucket, and when that changes.

In one process, a fake transport for worker 0 of two (``_one_peer.py``) records each
``plan``: buckets in reverse registration order grouped at the bucket size, one per
dtype; after the first synchronised step, backward's order where buckets leave during
it; parameters registered after the buckets were built join once a gradient shows them
used; a model the program dropped (here, or on the peer) leaves at the next ``finalize``;
and the transport ``plan`` returns carries the buckets.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.gradient_sync.bucketed._one_peer import (
    ALL_REDUCE,
    SHARED_MEMORY,
    WAYS,
    Rig,
    assert_grads,
    autograd_grads,
    combined,
    rig,
    twin,
)

pytestmark = pytest.mark.timeout(30)


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))


def _named(module: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in module.named_parameters()}


def _plan_names(r: Rig, names: dict[int, str], plan: int = -1) -> list[list[str]]:
    return [[names[i] for i in bucket] for bucket in r.transport.plans[plan]]


def _step(r: Rig, make, model: nn.Module, seed: int):
    """Worker 0's backward on its batch, the peer's gradients on another; the expected gradients."""
    g = torch.Generator().manual_seed(seed)
    x, y, px, py = (torch.randn(8, n, generator=g) for n in (2, 1, 2, 1))
    copy = twin(make, model)
    mine = autograd_grads(copy, lambda m: F.mse_loss(m(x), y))
    theirs = autograd_grads(copy, lambda m: F.mse_loss(m(px), py))
    r.peer.set({p: theirs[name] for name, p in model.named_parameters()})
    model.zero_grad(set_to_none=True)
    F.mse_loss(model(x), y).backward()
    return combined(mine, theirs, r.divisor)


@pytest.mark.parametrize(("bucket_bytes", "default_bytes"), [(32, 1 << 20), (0, 32)],
                         ids=["asked_for", "the_transports_default"])
def test_buckets_group_parameters_by_size_in_reverse_registration_order_one_dtype_each(bucket_bytes, default_bytes):
    """Reverse registration order (backward's, for a model made in forward order), a bucket
    closing once it holds ``bucket_bytes`` (the transport's default where none was asked
    for), one dtype per bucket; each flat holds the gradients, then one flag per parameter."""
    r = rig(ALL_REDUCE, bucket_bytes=bucket_bytes, default_bytes=default_bytes)
    scale = nn.Parameter(torch.ones(2, dtype=torch.float64))
    model = _mlp()  # bytes: 0.weight 32, 0.bias 16, 2.weight 64, 2.bias 16, 4.weight 16, 4.bias 4
    r.sync.register(scale)
    r.enroll(model)
    names = {**_named(model), id(scale): "scale"}
    assert _plan_names(r, names) == [["4.bias", "4.weight", "2.bias"], ["2.weight"], ["0.bias", "0.weight"], ["scale"]]
    for bucket in r.transport.buckets:
        assert bucket.flat.dtype == bucket.params[0].dtype
        assert bucket.flat.numel() == sum(p.numel() for p in bucket.params) + len(bucket.params)
        assert all(v.shape == p.shape and v.untyped_storage().data_ptr() == bucket.flat.untyped_storage().data_ptr()
                   for p, v in zip(bucket.params, bucket.views))
    assert r.sync.parameters_in_buckets == 7


class _OutOfOrder(nn.Module):
    """Its output layer is made first: registration order is not backward's."""

    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(4, 1)
        self.inp = nn.Linear(2, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.inp(x)))


@pytest.mark.parametrize("way", WAYS, ids=str)
def test_buckets_follow_backwards_order_after_the_first_step_where_they_leave_during_it(way):
    """As DDP's bucket rebuild: after the first step, buckets follow the order backward
    produced the gradients in (worker 0's, broadcast), once; where every bucket is reduced
    when backward ends the order does not matter and the buckets stay."""
    r = rig(way, bucket_bytes=1)  # a bucket per parameter
    model = _OutOfOrder()
    r.enroll(model)
    names = _named(model)
    produced: list[str] = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, name=name: produced.append(name))
    assert _plan_names(r, names) == [["inp.bias"], ["inp.weight"], ["out.bias"], ["out.weight"]]
    for seed in range(3):
        assert_grads(model, _step(r, _OutOfOrder, model, seed))
    first = produced[:4]
    assert set(first[:2]) == {"out.weight", "out.bias"}
    if way.overlaps_backward:
        assert len(r.transport.plans) == 2 and _plan_names(r, names) == [[name] for name in first]
        assert r.control.operations.count("gradient bucket order") == 1
    else:
        assert len(r.transport.plans) == 1 and "gradient bucket order" not in r.control.operations


@pytest.mark.parametrize("way", WAYS, ids=str)
def test_a_parameter_registered_after_the_buckets_joins_them_once_used(way):
    """A layer registered after ``finalize`` (a copy made after the scope) waits outside
    the buckets; the first backward that gives it a gradient all-reduces it on its own (the
    mean) and rebuilds the buckets with it. A copy never differentiated (an EMA) stays out,
    and costs no agreement at steps where no late parameter was used here."""
    r = rig(way)
    base = _mlp()
    r.enroll(base)
    late, ema = nn.Linear(1, 1), nn.Linear(1, 1)
    for p in [*late.parameters(), *ema.parameters()]:
        r.sync.register(p)
    assert r.sync.parameters_in_buckets == 6 and len(r.transport.plans) == 1
    model = nn.Sequential(base, late)

    def make() -> nn.Module:
        return nn.Sequential(_mlp(), nn.Linear(1, 1))

    for seed in range(3):
        assert_grads(model, _step(r, make, model, seed))
        assert r.sync.parameters_in_buckets == 8
        assert ema.weight.grad is None
    planned = {i for bucket in r.transport.plans[-1] for i in bucket}
    assert {id(p) for p in late.parameters()} <= planned and not {id(p) for p in ema.parameters()} & planned
    assert r.control.operations.count("late parameters") == 1
    assert r.control.operations.count("gradient all-reduce") == 2  # late's weight and bias, once each


def test_a_late_layer_used_where_no_bucketed_one_was_is_reduced_at_the_optimizer_step():
    """No bucketed parameter got a gradient, so no backward-end callback ran: ``pre_step``
    (what ``opt.step()`` calls first) finds the late layer used and reduces it (the mean)."""
    r = rig(ALL_REDUCE)
    base = _mlp()
    r.enroll(base)
    late = nn.Linear(2, 1)
    for p in late.parameters():
        r.sync.register(p)
    expected = _step(r, lambda: nn.Linear(2, 1), late, 0)
    assert not r.transport.launches
    r.sync.pre_step(torch.optim.SGD(late.parameters(), lr=0.1), (), {})
    assert_grads(late, expected)
    assert r.sync.parameters_in_buckets == 8


def test_a_dropped_model_leaves_the_buckets_at_the_next_finalize():
    """The buckets hold a model the program dropped only until the next ``finalize``; then
    it is gone (garbage collected) and the buckets hold the live model's parameters."""
    r = rig(ALL_REDUCE)
    kept, dropped = _mlp(), _mlp()
    r.enroll(kept, dropped)
    assert r.sync.parameters_in_buckets == 12
    gone = weakref.ref(dropped[0].weight)
    del dropped
    r.sync.finalize()
    gc.collect()
    assert gone() is None
    assert r.sync.parameters_in_buckets == 6
    assert {i for bucket in r.transport.plans[-1] for i in bucket} == {id(p) for p in kept.parameters()}
    assert_grads(kept, _step(r, _mlp, kept, 0))


def test_a_model_the_peer_dropped_leaves_the_buckets_here_too():
    """The layout must match on every worker: a model dropped on the peer (its garbage
    collector ran, this one's not yet) leaves the buckets here as well, though alive."""
    r = rig(SHARED_MEMORY)
    kept, dropped = _mlp(), _mlp()
    r.enroll(kept, dropped)
    r.peer.answers["gradient bucket layout"] = [1] * 6 + [0] * 6  # registration order: kept, then dropped
    r.sync.finalize()
    assert r.sync.parameters_in_buckets == 6
    assert {i for bucket in r.transport.plans[-1] for i in bucket} == {id(p) for p in kept.parameters()}
    assert_grads(kept, _step(r, _mlp, kept, 0))
    F.mse_loss(dropped(torch.ones(3, 2)), torch.zeros(3, 1)).backward()  # its gradients travel no more
    assert r.transport.finished == 1


def test_the_transport_plan_returns_carries_the_buckets():
    """``plan`` may hand the buckets to another transport (a fallback): that one launches
    them, and its ``overlaps_backward`` and ``hand_out`` decide how (here: all at the end,
    copied out)."""
    r = rig(ALL_REDUCE, carrier=SHARED_MEMORY)
    model = _mlp()
    r.enroll(model)
    carrier = r.transport.carrier
    assert r.sync.bucket_transport is carrier and r.sync.overlap_bucket_bytes is None
    for seed in range(2):
        assert_grads(model, _step(r, _mlp, model, seed))
    assert not r.transport.launches and len(carrier.launches) == 2 and carrier.finished == 2
    (bucket,) = carrier.buckets
    assert all(p.grad.untyped_storage().data_ptr() != bucket.flat.untyped_storage().data_ptr()
               for p in model.parameters())
