"""A bucket's own part of a step (``_gradient_sync/bucketed/bucket_gradients.py``), one function at a time.

Each function gets a hand-made ``GradientBucket`` and a transport that only reports sums
set by the test: this worker's flags, the gradients' way into the flat from their slots,
and the sums' way back out as views of the bucket's flat or as copies of a shared result.
"""

from __future__ import annotations

import pytest
import torch

from unison._collectives.transport.bucket_transports import BucketTransport, GradientBucket, HandOut
from unison._collectives.transport.flat_buffers import views_of
from unison._gradient_sync.bucketed.bucket_gradients import (
    as_divisor,
    copy_sums_out,
    fill_around,
    fill_from_slots,
    hand_out_views,
    home_held_elsewhere,
    point_grads_at_slots,
    set_flags,
)

pytestmark = pytest.mark.timeout(30)


class _Sums(BucketTransport):
    """Reports ``shared`` as the bucket's sums (gradients, then the flags' sums); counts the
    reads of the flags' sums (on a GPU each is a sync)."""

    def __init__(self, shared: torch.Tensor | None = None):
        self.shared = shared
        self.flag_reads = 0

    @property
    def overlaps_backward(self) -> bool:
        return False

    @property
    def hand_out(self) -> HandOut:
        return HandOut.VIEWS if self.shared is None else HandOut.COPIES

    def launch(self, bucket: GradientBucket, divisor: int) -> None:
        raise AssertionError("not launched here")

    def finish(self, buckets: list[GradientBucket]) -> None:
        raise AssertionError("not finished here")

    def sums(self, bucket: GradientBucket) -> torch.Tensor:
        return bucket.flat if self.shared is None else self.shared

    def sum_views(self, bucket: GradientBucket) -> list[torch.Tensor]:
        return bucket.views if self.shared is None else views_of(self.shared[:bucket.size], bucket.params)

    def used_sums(self, bucket: GradientBucket) -> list[float]:
        self.flag_reads += 1
        return super().used_sums(bucket)


def _bucket(*shapes: tuple[int, ...]) -> GradientBucket:
    params = [torch.zeros(shape, requires_grad=True) for shape in shapes]
    size = sum(p.numel() for p in params)
    flat = torch.zeros(size + len(params))
    return GradientBucket(params, views_of(flat[:size], params), flat, plain=True)


def _sums(bucket: GradientBucket, flags: list[float]) -> torch.Tensor:
    """A reduced flat: distinct values per element, then ``flags``."""
    return torch.cat([torch.arange(1.0, bucket.size + 1), torch.tensor(flags)])


def test_set_flags_marks_every_parameter_but_the_missing_ones():
    used = torch.full((4,), 7.0)
    set_flags(used, [1, 3])
    assert used.tolist() == [1.0, 0.0, 1.0, 0.0]
    set_flags(used, [])
    assert used.tolist() == [1.0] * 4


def test_hand_out_views_gives_each_reduced_gradient_its_view_and_none_where_no_worker_had_one():
    """A gradient becomes its view of the reduced flat; None stays None where the flags sum
    to zero (no worker computed one), for a frozen parameter, and for a sparse gradient
    summed apart (kept as it is)."""
    bucket = _bucket((2, 2), (3,), (2,), (1,), (2,))
    unused, peer_only, frozen, sparse, kept = bucket.params
    frozen.requires_grad_(False)
    sparse_grad = torch.zeros(1).to_sparse()
    sparse.grad = sparse_grad
    kept.grad = bucket.views[4]  # zero_grad(set_to_none=False) kept last step's view
    bucket.flat.copy_(_sums(bucket, [0, 1, 0, 0, 2]))
    transport = _Sums()
    hand_out_views(bucket, transport, {id(sparse)})
    assert unused.grad is None and frozen.grad is None
    assert peer_only.grad is bucket.views[1] and peer_only.grad.tolist() == [5.0, 6.0, 7.0]
    assert sparse.grad is sparse_grad and kept.grad is bucket.views[4]
    assert transport.flag_reads == 1


def test_hand_out_views_reads_no_flags_where_every_gradient_is_there_or_frozen():
    bucket = _bucket((2,), (2,))
    present, frozen = bucket.params
    frozen.requires_grad_(False)
    present.grad = torch.ones(2)
    transport = _Sums()
    hand_out_views(bucket, transport, set())
    assert present.grad is bucket.views[0] and frozen.grad is None
    assert transport.flag_reads == 0


def test_copy_sums_out_copies_into_the_gradients_and_never_hands_out_the_shared_memory():
    """Contiguous gradients take the sums in place (the same tensors); a missing one that a
    peer computed gets a fresh copy; one whose flags sum to zero, a frozen one and a sparse
    one summed apart keep what they had; a non-contiguous one is replaced by a copy. None of
    them is memory of the shared result."""
    bucket = _bucket((2, 2), (3,), (2,), (2,), (1,), (2, 3))
    own, peer_only, unused, frozen, sparse, strided = bucket.params
    frozen.requires_grad_(False)
    own_grad = own.grad = torch.full((2, 2), 9.0)
    sparse_grad = sparse.grad = torch.ones(1).to_sparse()
    strided.grad = torch.zeros(3, 2).t()
    shared = _sums(bucket, [2, 1, 0, 0, 0, 2])
    kept = shared.clone()
    copy_sums_out(bucket, _Sums(shared), {id(sparse)})
    assert own.grad is own_grad and own.grad.flatten().tolist() == [1.0, 2.0, 3.0, 4.0]
    assert peer_only.grad.tolist() == [5.0, 6.0, 7.0]
    assert unused.grad is None and frozen.grad is None and sparse.grad is sparse_grad
    assert strided.grad.flatten().tolist() == [13.0, 14.0, 15.0, 16.0, 17.0, 18.0]
    shared_memory = shared.untyped_storage().data_ptr()
    for p in (own, peer_only, strided):
        assert p.grad.untyped_storage().data_ptr() != shared_memory
        p.grad.zero_()  # a worker zeroing its gradients in place (zero_grad(set_to_none=False))
    assert torch.equal(shared, kept)


def _in_slots(*shapes: tuple[int, ...]) -> GradientBucket:
    """A bucket whose last step's gradients could all live in slots, pointed at them now
    (as at the first gradient of a backward pass)."""
    bucket = _bucket(*shapes)
    bucket.in_slots_next = True
    point_grads_at_slots([bucket], _no_home)
    assert bucket.slots is not None and bucket.slots.in_slots([p.grad for p in bucket.params])
    return bucket


def _no_home(bucket: GradientBucket) -> None:
    raise AssertionError("a bucket without a home left it")


def test_fill_from_slots_divides_the_slots_into_the_flat_and_flags_the_slots_nobody_wrote():
    bucket = _in_slots((2,), (3,))
    written, untouched = bucket.params
    written.grad.add_(torch.tensor([4.0, 6.0]))  # as autograd accumulates into a slot
    assert fill_from_slots(bucket, 2)
    assert bucket.launched_from_slots and bucket.unwritten == (1,)
    assert bucket.flat.tolist() == [2.0, 3.0, 0.0, 0.0, 0.0, 1.0, 0.0]


def test_fill_from_slots_declines_a_bucket_whose_gradient_left_its_slot():
    bucket = _in_slots((2,), (3,))
    bucket.params[0].grad = torch.ones(2)  # set by the user: no longer the slot
    assert not fill_from_slots(bucket, 2)
    assert not bucket.launched_from_slots and bucket.flat.abs().sum() == 0


@pytest.mark.parametrize("peer_wrote", [True, False])
def test_copy_sums_out_into_slots_leaves_none_where_no_worker_wrote_the_slot(peer_wrote):
    """Launched from its slots, the sums are copied into the slots (the gradients); a slot
    this worker never wrote keeps the peer's share, or goes back to None where no worker
    computed that gradient."""
    bucket = _in_slots((2,), (3,))
    written, untouched = bucket.params
    slots = [p.grad for p in bucket.params]
    written.grad.add_(1.0)
    assert fill_from_slots(bucket, 1)
    shared = _sums(bucket, [2, int(peer_wrote)])
    copy_sums_out(bucket, _Sums(shared), set())
    assert written.grad is slots[0] and written.grad.tolist() == [1.0, 2.0]
    if peer_wrote:
        assert untouched.grad is slots[1] and untouched.grad.tolist() == [3.0, 4.0, 5.0]
    else:
        assert untouched.grad is None
    assert written.grad.untyped_storage().data_ptr() != shared.untyped_storage().data_ptr()


def _at_home(*shapes: tuple[int, ...]) -> GradientBucket:
    """A bucket of slots the transport gave a home (its flat, standing for this worker's part of
    the shared file), its last step's gradients fit for the slots."""
    bucket = _bucket(*shapes)
    bucket.wants_slots, bucket.in_slots_next = True, True
    bucket.home, bucket.undivided = bucket.flat[:bucket.size], True
    return bucket


def test_slots_in_a_home_are_that_memory_so_nothing_is_copied_in_or_out():
    """The gradients are pointed at the home itself: filling the flat from them copies
    nothing, and the sums that come back into the home are the gradients."""
    bucket = _at_home((2,), (3,))
    point_grads_at_slots([bucket], _no_home)
    home = bucket.home
    assert home is not None
    first, second = bucket.params
    assert first.grad.data_ptr() == home.data_ptr() and second.grad.data_ptr() == home[2:].data_ptr()
    first.grad.add_(torch.tensor([4.0, 6.0]))  # as autograd accumulates into a slot
    second.grad.add_(1.0)
    assert fill_from_slots(bucket, 1)
    assert bucket.launched_from_slots and bucket.unwritten == ()
    assert bucket.flat.tolist() == [4.0, 6.0, 1.0, 1.0, 1.0, 1.0, 1.0]  # undivided, in place
    bucket.flat.copy_(_sums(bucket, [2, 2]))  # the transport writes the sums back into the home
    aliases = [first.grad, second.grad]
    copy_sums_out(bucket, _Sums(bucket.flat), set())
    assert first.grad is aliases[0] and second.grad is aliases[1]  # still the slots, now holding the sums
    assert first.grad.tolist() == [1.0, 2.0] and second.grad.tolist() == [3.0, 4.0, 5.0]


@pytest.mark.parametrize("kept_how", ["alias", "view"])
def test_a_home_someone_holds_is_left_for_good_and_what_they_hold_keeps_its_values(kept_how):
    """A gradient kept from the last step (the tensor, or a view that holds its memory)
    makes the bucket leave its home, so the transport writes there no more: fresh slots of
    its own, filled into the spare flat the transport gives instead."""
    bucket = _at_home((2,), (3,))
    point_grads_at_slots([bucket], _no_home)
    home = bucket.home
    first, second = bucket.params
    first.grad.add_(torch.tensor([4.0, 6.0]))
    kept = first.grad if kept_how == "alias" else first.grad.detach().view(2)
    before = kept.clone()
    for p in bucket.params:
        p.grad = None  # zero_grad()
    left = []

    def leave(b: GradientBucket) -> None:  # as a transport does: a spare flat, never handed out
        left.append(b)
        b.flat = torch.zeros_like(b.flat)
        b.views, b.home = views_of(b.flat[:b.size], b.params), None

    point_grads_at_slots([bucket], leave)
    assert left == [bucket] and bucket.home is None and bucket.undivided
    assert bucket.slots is not None and bucket.slots.in_slots([p.grad for p in bucket.params])
    assert all(p.grad.untyped_storage().data_ptr() != home.untyped_storage().data_ptr() for p in bucket.params)
    first.grad.add_(1.0)
    assert fill_from_slots(bucket, 1)
    assert bucket.flat[:2].tolist() == [1.0, 1.0]
    assert torch.equal(kept, before) and home[:2].tolist() == [4.0, 6.0]


@pytest.mark.parametrize("kept_how", [None, "alias", "view", "stays_the_gradient"])
def test_a_few_gradients_are_handed_out_as_views_of_their_home_until_one_is_kept(kept_how):
    """A bucket of few gradients whose sums came back into its home: each gradient becomes
    its view of the home (no copy). Next step the home counts as held when a gradient handed
    out was kept past ``zero_grad()`` (the tensor, or a view holding its memory), not when it
    simply stayed the gradient (``zero_grad(set_to_none=False)``)."""
    bucket = _bucket((2,), (3,))
    bucket.home = bucket.flat[:bucket.size]
    assert not home_held_elsewhere(bucket)  # nothing handed out yet
    bucket.flat.copy_(_sums(bucket, [2, 2]))  # the sums, back in the home
    copy_sums_out(bucket, _Sums(bucket.flat), set())
    first, second = bucket.params
    assert first.grad is bucket.views[0] and second.grad is bucket.views[1]
    assert first.grad.tolist() == [1.0, 2.0] and second.grad.tolist() == [3.0, 4.0, 5.0]
    kept = {None: None, "alias": first.grad, "view": first.grad.detach()[:1], "stays_the_gradient": None}[kept_how]
    if kept_how != "stays_the_gradient":
        for p in bucket.params:
            p.grad = None  # zero_grad()
    assert home_held_elsewhere(bucket) == (kept is not None)


def test_fill_around_leaves_the_owners_range_to_be_read_from_the_gradients_themselves():
    """Everything but ``own`` is divided into the flat; inside it nothing is written, and the gradients'
    pieces there (undivided, in order, across parameters) are handed over with the divisor."""
    bucket = _bucket((2, 3), (4,), (3,))  # 13 elements, then 3 flags
    grads = [torch.arange(6.0).reshape(2, 3) + 1, torch.arange(4.0) + 10, torch.arange(3.0) + 20]
    for param, grad in zip(bucket.params, grads):
        param.grad = grad
    bucket.flat.fill_(float("nan"))
    assert fill_around(bucket, 2, (4, 11), set())
    written = torch.cat([g.reshape(-1) for g in grads]) / 2
    assert torch.equal(bucket.flat[:4], written[:4]) and torch.equal(bucket.flat[11:13], written[11:13])
    assert bucket.flat[4:11].isnan().all()  # left to the transport
    assert bucket.used.tolist() == [1.0, 1.0, 1.0]
    assert [(lo, hi) for lo, hi, _ in bucket.own_parts] == [(4, 6), (6, 10), (10, 11)]
    assert all(piece.data_ptr() == grad.data_ptr() + (lo - first) * 4 for (lo, _, piece), grad, first
               in zip(bucket.own_parts, grads, (0, 6, 10)))  # the gradients themselves, not copies
    assert bucket.own_divisor == 2


@pytest.mark.parametrize("why", ["missing", "sparse", "in the flat", "divisor 3"])
def test_fill_around_declines_and_writes_nothing_where_a_piece_could_not_be_read_as_it_is(why):
    bucket = _bucket((2, 3), (4,))
    grads = [torch.ones(2, 3), torch.ones(4)]
    if why == "in the flat":  # zero_grad(set_to_none=False) kept a gradient handed out as a view of it
        grads[1] = bucket.views[1]
    for param, grad in zip(bucket.params, grads):
        param.grad = grad
    if why == "missing":
        bucket.params[0].grad = None
    bucket.flat.fill_(float("nan"))
    sparse = {id(bucket.params[1])} if why == "sparse" else set()
    assert not fill_around(bucket, 3 if why == "divisor 3" else 2, (0, 5), sparse)
    assert bucket.flat.isnan().all() and bucket.own_parts is None



_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("divisor", [2, 3, 4, 6, 8])
def test_dividing_by_a_divisor_tensor_gives_the_bits_of_dividing_by_the_number(dtype, divisor):
    """``as_divisor``'s tensor in place of the number, into another tensor and in place: the
    same bits, also for subnormals, the extremes, infinities and NaN."""
    info = torch.finfo(dtype)
    special = torch.tensor([0.0, -0.0, info.tiny, -info.tiny, info.tiny / 4, info.max, -info.max, info.eps,
                            float("inf"), float("-inf"), float("nan")], dtype=torch.float64).to(dtype)
    drawn = torch.randn(997, generator=torch.Generator().manual_seed(divisor), dtype=torch.float64) * 1e3
    values = torch.cat([drawn.to(dtype), special])
    bits = _BITS[dtype.itemsize]
    want = (values / divisor).view(bits)
    into = torch.empty_like(values)
    torch.div(values, as_divisor(divisor), out=into)
    assert torch.equal(into.view(bits), want)
    assert torch.equal(values.clone().div_(as_divisor(divisor)).view(bits), want)
    assert as_divisor(divisor) is as_divisor(divisor)  # made once
