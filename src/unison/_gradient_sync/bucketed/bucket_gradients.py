"""How this worker's gradients get into a gradient bucket and the sums back out.

The bucket's own part of a synchroniser's step, apart from how it travels: the flags,
the gradients that live in flat slots of the bucket (``GradSlots``,
``_gradient_sync/grads_as_buffer_views.py``, where the sums are copied out of shared
memory), and handing the sums out as views or copies. A parameter whose flags sum to
zero got no gradient on any worker and keeps none; one whose flags sum below zero has a
sparse gradient on some worker (``SPARSE_FLAG``), summed apart by the synchroniser once
the buckets are reduced, where this worker learns of it from the sums.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from unison._collectives.transport.bucket_transports import BucketTransport, GradientBucket
from unison._gradient_sync.grad_access import grads_of
from unison._gradient_sync.grads_as_buffer_views import GradSlots, fits, held_beyond
from unison._interpose.torch_private import storage_use_count

__all__ = ["SPARSE_FLAG", "as_divisor", "set_flags", "point_grads_at_slots", "fill_from_slots", "fill_around",
           "copy_sums_out", "hand_out_views", "home_held_elsewhere"]


SPARSE_FLAG = -1.0
"""The flag of a parameter whose gradient is sparse here: its slot stays empty, and the sign of the
flags' sum tells every worker, also one that computed no gradient for it, to join its sparse sum."""


_DIVISORS: dict[int, torch.Tensor] = {}


def as_divisor(divisor: int) -> torch.Tensor:
    """``divisor`` as a 0-dim float64 CPU tensor, made once: dividing by it gives the bits dividing by
    the number gives (the same kernel), but skips wrapping a Python number into a tensor on every
    call (an in-place division of D's 112-element bucket: 0.8 us against 2.3 on this VM)."""
    found = _DIVISORS.get(divisor)
    if found is None:
        found = _DIVISORS.setdefault(divisor, torch.tensor(float(divisor), dtype=torch.float64))
    return found


def set_flags(used: torch.Tensor, missing: Sequence[int], sparse: Sequence[int] = ()) -> None:
    """This worker's flags: 1 for each parameter of the bucket, 0 for those in ``missing``,
    ``SPARSE_FLAG`` for those in ``sparse``."""
    used.fill_(1)
    if missing:
        used[list(missing)] = 0
    if sparse:
        used[list(sparse)] = SPARSE_FLAG


def point_grads_at_slots(buckets: Sequence[GradientBucket], leave_home: Callable[[GradientBucket], None]) -> None:
    """At the first gradient of a backward pass whose sums are copied out (shared memory):
    the gradients of each bucket whose last step's gradients
    could all live in flat slots are pointed at them, so autograd accumulates into them
    and the bucket reaches the transport's flat in one pass (none where the transport gave
    the bucket a ``home``: the slots are that memory). Buckets with a sparse or a
    missing gradient last step keep their own tensors: a sparse gradient added into a
    dense slot would stop being sparse. Slots someone kept a gradient of are left to them:
    the bucket takes fresh slots of its own, and leaves its home for good (``leave_home``:
    the transport writes there no more)."""
    for bucket in buckets:
        if not bucket.in_slots_next:
            continue
        grads = grads_of(bucket.params)
        slots = bucket.slots
        if slots is not None and slots.in_slots(grads):
            slots.untouched = []  # zero_grad(set_to_none=False): every gradient is a tensor already
            continue  # accumulating into the slots already
        if slots is None:
            slots = bucket.slots = GradSlots(bucket.params, bucket.home)
        elif slots.held_elsewhere(grads):  # never overwrite a gradient someone kept
            if bucket.home is not None:
                leave_home(bucket)
            slots = bucket.slots = GradSlots(bucket.params)
        try:
            # a slot autograd never writes is a gradient this worker did not compute (see unwritten)
            slots.point_grads(grads, track_unwritten=True)
        except RuntimeError:  # a parameter resized since (param.data = ...): its own tensors from now on
            bucket.slots, bucket.in_slots_next = None, False


def fill_from_slots(bucket: GradientBucket, divisor: int) -> bool:
    """Writes a bucket whose gradients all live in its slots into its flat in one pass
    (divided for MEAN, as the per-gradient path divides); False otherwise."""
    slots = bucket.slots
    bucket.launched_from_slots = slots is not None and slots.in_slots(grads_of(bucket.params))
    if slots is None or not bucket.launched_from_slots:
        return False
    (gradients,) = slots.flats.values()  # a bucket holds one dtype
    body = bucket.flat[:bucket.size]
    if gradients.data_ptr() == body.data_ptr():  # the slots are the bucket's home: already there
        if divisor != 1:
            body.div_(as_divisor(divisor))
    elif divisor != 1:
        torch.div(gradients, as_divisor(divisor), out=body)
    else:
        body.copy_(gradients)
    bucket.unwritten = tuple(sorted(slots.never_written())) if slots.untouched else ()
    slots.untouched = []
    set_flags(bucket.used, bucket.unwritten)
    return True


def fill_around(bucket: GradientBucket, divisor: int, own: tuple[int, int], sparse: set[int]) -> bool:
    """Divides the gradients into the bucket's flat except the range ``own`` (the transport reads
    this worker's part there from the gradients themselves: ``BucketTransport.own_range``), whose
    pieces go to ``bucket.own_parts``, and sets the flags; False, writing nothing, unless every
    gradient is a dense tensor of its parameter's shape in memory of its own and ``divisor`` a
    power of two (the transport then divides those pieces exactly as it adds them).
    ``sparse``: ids of parameters whose (sparse) gradient was summed apart."""
    if divisor & (divisor - 1):
        return False
    flat = bucket.flat
    grads = grads_of(bucket.params)
    storage = flat.untyped_storage().data_ptr()
    for param, grad, view in zip(bucket.params, grads, bucket.views):
        if (grad is None or id(param) in sparse or not fits(grad, view) or not grad.is_contiguous()
                or grad.untyped_storage().data_ptr() == storage):
            return False
    start, end = own
    parts: list[tuple[int, int, torch.Tensor]] = []
    base = int(flat.storage_offset())
    for grad, view in zip(grads, bucket.views):
        assert grad is not None  # checked above
        first = int(view.storage_offset()) - base
        last = first + view.numel()
        source, target = grad.view(-1), view.view(-1)
        for lo, hi in ((first, min(last, start)), (max(first, end), last)):  # outside this worker's range
            if lo < hi:
                if divisor == 1:
                    target[lo - first:hi - first].copy_(source[lo - first:hi - first])
                else:
                    torch.div(source[lo - first:hi - first], as_divisor(divisor), out=target[lo - first:hi - first])
        lo, hi = max(first, start), min(last, end)
        if lo < hi:
            parts.append((lo, hi, source[lo - first:hi - first]))
    set_flags(bucket.used, ())
    bucket.own_parts, bucket.own_divisor = parts, divisor
    return True


def home_held_elsewhere(bucket: GradientBucket) -> bool:
    """Whether something besides unison and the parameters' ``.grad`` holds the home of a
    bucket whose sums were handed out as views of it (a gradient kept from an earlier step,
    a view of one): its next gradients must not be written there (``leave_home``)."""
    if bucket.home is None or bucket.home_holders is None:
        return False  # no home, or nothing handed out of it yet
    return held_beyond(bucket.views, grads_of(bucket.params)) or storage_use_count(bucket.flat) != bucket.home_holders


def copy_sums_out(bucket: GradientBucket, transport: BucketTransport, sparse: set[int]) -> list[torch.Tensor]:
    """Hands a shared bucket's sums to the parameters' gradients: one foreach copy, or none
    where the sums came back into this worker's home.

    The shared result cannot become the gradient itself: a worker that zeroes its
    gradients in place (``zero_grad(set_to_none=False)``) would zero a peer's too.
    Gradients that live in the bucket's own slots take one copy, those in its home
    (this worker's own part of the file, where the sums came back) none. A few large
    gradients become views of the home (no copy); ``home_held_elsewhere`` tells when one
    was kept. ``sparse``: ids of parameters whose gradient is sparse here (summed apart).

    Returns the parameters without a gradient here that some worker has a sparse gradient for
    (their sums were left alone: the synchroniser sums them apart).
    """
    if bucket.home is not None and not bucket.wants_slots:
        if bucket.home_holders is None:
            bucket.home_holders = storage_use_count(bucket.flat)
        return hand_out_views(bucket, transport, sparse)
    sparse_elsewhere: list[torch.Tensor] = []
    if bucket.launched_from_slots:  # no user code ran since: the gradients are still the slots
        assert bucket.slots is not None
        (gradients,) = bucket.slots.flats.values()
        reduced = transport.sums(bucket)[:bucket.size]
        if gradients.data_ptr() != reduced.data_ptr():
            gradients.copy_(reduced)
        if bucket.unwritten:  # slots this worker left unwritten: None again where no worker wrote one
            everywhere = transport.used_sums(bucket)
            for k in bucket.unwritten:
                if everywhere[k] <= 0:
                    bucket.params[k].grad = None
                    if everywhere[k] < 0:
                        sparse_elsewhere.append(bucket.params[k])
        return sparse_elsewhere
    targets, sources = [], []
    sums: list[float] | None = None
    for k, (param, result) in enumerate(zip(bucket.params, transport.sum_views(bucket), strict=True)):
        grad = param.grad
        if id(param) in sparse:
            continue
        if grad is None:
            if not param.requires_grad:
                continue  # frozen: no worker computed one
            if sums is None:
                sums = transport.used_sums(bucket)
            if sums[k] < 0:
                sparse_elsewhere.append(param)  # summed apart: a peer's gradient is sparse
            elif sums[k] != 0:  # else no worker computed one (a head this step skipped)
                param.grad = result.clone()  # no gradient here this step; the peers' mean still applies
        elif grad.is_contiguous() and grad.layout == torch.strided:
            if grad.data_ptr() != result.data_ptr():  # else it lives where its sum came back
                targets.append(grad)
                sources.append(result)
        else:
            param.grad = result.clone()
    if targets:
        torch._foreach_copy_(targets, sources)
    return sparse_elsewhere


def hand_out_views(bucket: GradientBucket, transport: BucketTransport, sparse: set[int]) -> list[torch.Tensor]:
    """Makes each gradient a view of the bucket's reduced flat (the bucket's own memory); returns
    the parameters left without one that some worker has a sparse gradient for (as ``copy_sums_out``)."""
    sums: list[float] | None = None
    sparse_elsewhere: list[torch.Tensor] = []
    for k, (param, view) in enumerate(zip(bucket.params, bucket.views)):
        # still the view when zero_grad(set_to_none=False) kept it: setting .grad costs more
        grad = param.grad
        if grad is view or id(param) in sparse:
            continue
        if grad is None:
            if not param.requires_grad:
                continue  # frozen: no worker computed one (and no look at the sums: on a GPU, a sync)
            if sums is None:
                sums = transport.used_sums(bucket)
            if sums[k] == 0:
                continue  # no worker computed one (a head this step skipped): the optimizer skips it
            if sums[k] < 0:
                sparse_elsewhere.append(param)  # summed apart: a peer's gradient is sparse
                continue
        param.grad = view
    return sparse_elsewhere
