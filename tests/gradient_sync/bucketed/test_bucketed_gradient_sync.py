"""``BucketedGradientSync`` (``_gradient_sync/bucketed/buckets.py``) in one process, against plain autograd.

Worker 0 of two runs its backward for real; the second worker is a known tensor that
the fake bucket transport adds (``_one_peer.py``): its gradients by plain autograd on its
own batch. So after ``backward()`` returns (no ``opt.step()`` needed: the buckets are
reduced when backward ends) each gradient must be ``(mine + peer's) / 2`` (MEAN) or the
sum (SUM); None where no worker computed one; the peer's share where only it did. Every
way a real transport behaves is played: buckets leaving during backward and handed out as
views of their flat (``AllReduceBuckets``), all at its end and copied out of shared
memory (``SharedMemoryBuckets``, with the gradients in the buckets' own slots from the
second step when a bucket holds more than 16), leaving during backward and copied out
(``PipelinedHostBuckets``), and a transport that reduces the gradients themselves
(``PowerSGDBuckets``, exact here).

A sparse gradient only the peer computed gets its share here too: its flag (-1) tells this
worker to join the sparse all-reduce. Not under PowerSGD, which carries no flags (marked
``xfail(strict=True)``). A parameter whose gradient was sparse once and is dense now is
reduced again (it was left out for good).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.gradient_sync.bucketed._one_peer import (
    ACROSS_HOSTS,
    ALL_REDUCE,
    SHARED_MEMORY,
    WAYS,
    Grads,
    Rig,
    assert_grads,
    autograd_grads,
    combined,
    rig,
    twin,
)
from unison._collectives.transport.bucket_transports import HandOut
from unison._gradient_sync.step_hooks import attach, install_step_hooks
from unison._reduce import ReduceOp
from unison.errors import GradientSyncError

pytestmark = pytest.mark.timeout(30)

FEW, MANY = 1, 6  # trunk layers: 8 gradients in the bucket (each divided into its slot), or 18 (> 16: slots)
STEPS = 3
ALL_HEADS = (0, 1, 2)


class Net(nn.Module):
    """A trunk of ``layers`` Linear+Tanh blocks and three heads; ``heads`` says which are used."""

    def __init__(self, layers: int = FEW):
        super().__init__()
        self.trunk = nn.Sequential(*[block for _ in range(layers) for block in (nn.Linear(4, 4), nn.Tanh())])
        self.heads = nn.ModuleList(nn.Linear(4, 3) for _ in range(3))

    def forward(self, x: torch.Tensor, heads: tuple[int, ...] = ALL_HEADS) -> torch.Tensor:
        h = self.trunk(x)
        return sum((self.heads[k](h) for k in heads), torch.zeros(()))


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)


def _loss(seed: int, heads: tuple[int, ...] = ALL_HEADS):
    x, y = _batch(seed)
    return lambda model: F.mse_loss(model(x, heads), y)


def _step(r: Rig, make, model: nn.Module, mine, theirs, set_to_none: bool = True) -> Grads:
    """One step of worker 0: the peer's gradients set, this worker's backward run; the expected gradients."""
    copy = twin(make, model)
    my_grads, peer_grads = autograd_grads(copy, mine), autograd_grads(copy, theirs)
    r.peer.set({p: peer_grads[name] for name, p in model.named_parameters()})
    model.zero_grad(set_to_none=set_to_none)
    mine(model).backward()
    return combined(my_grads, peer_grads, r.divisor)


@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zeroed_in_place"])
@pytest.mark.parametrize("op", [ReduceOp.MEAN, ReduceOp.SUM], ids=str)
@pytest.mark.parametrize("layers", [FEW, MANY], ids=["8_grads", "18_grads"])
@pytest.mark.parametrize("way", WAYS, ids=str)
def test_gradients_are_the_mean_of_both_workers_when_backward_returns(way, layers, op, set_to_none):
    """(mine + peer's) / 2 per parameter (MEAN), or the sum (SUM), every step; with
    ``zero_grad(set_to_none=False)`` the gradients kept from the last step (views of the
    bucket, or copies, or slots) are accumulated into and still reduced right."""
    r = rig(way, op=op)
    model = Net(layers)
    r.enroll(model)
    for step in range(STEPS):
        expected = _step(r, lambda: Net(layers), model, _loss(step), _loss(100 + step), set_to_none)
        assert_grads(model, expected)
    assert r.transport.finished == STEPS
    assert {launch.divisor for launch in r.transport.launches} == {r.divisor}
    if way.hand_out is HandOut.COPIES and layers == MANY:  # the slots path from the second step on
        assert [launch.from_slots for launch in r.transport.launches] == [False] + [True] * (STEPS - 1)
    assert all(launch.undivided == (way.homes and layers == MANY) for launch in r.transport.launches)


@pytest.mark.parametrize("layers", [FEW, MANY], ids=["8_grads", "18_grads"])
@pytest.mark.parametrize("way", WAYS, ids=str)
def test_a_parameter_no_worker_computed_keeps_none_and_one_only_the_peer_computed_gets_its_share(way, layers):
    """Heads: 0 used here, 1 by the peer only, 2 by nobody (after a first step that used
    all three, so a bucket of many gradients has its slots). Head 2's flags sum to zero: it
    keeps no gradient, as on one device (so an optimizer skips it); head 1 gets the peer's
    gradient / 2. A transport that reduces the gradients themselves (PowerSGD) takes a
    missing one as zeros instead, as it documents."""
    r = rig(way)
    model = Net(layers)
    r.enroll(model)
    make = lambda: Net(layers)  # noqa: E731
    assert_grads(model, _step(r, make, model, _loss(0), _loss(100)))
    for step in (1, 2):
        expected = _step(r, make, model, _loss(step, heads=(0,)), _loss(100 + step, heads=(1,)))
        assert expected["heads.1.weight"] is not None and expected["heads.2.weight"] is None
        if way.reads_gradients:
            expected.update({f"heads.2.{name}": torch.zeros_like(p) for name, p in model.heads[2].named_parameters()})
        assert_grads(model, expected)
        if not way.reads_gradients:  # this worker's flags: 0 for heads 1 and 2, 1 for the rest
            (launch,) = r.transport.launches[-1:]
            assert [launch.flag(p) for p in model.parameters()] == [True] * (2 * layers + 2) + [False] * 4
    if way.hand_out is HandOut.COPIES and layers == MANY:
        assert all(launch.from_slots for launch in r.transport.launches[1:])


@pytest.mark.parametrize("way", WAYS, ids=str)
def test_frozen_parameters_are_skipped_and_join_once_unfrozen(way):
    """A parameter created frozen stays out of the buckets (no all-reduce of zeros every
    step); one frozen after the buckets were built keeps its place, sends a 0 flag and keeps
    no gradient. Unfrozen, the first is all-reduced on its own that step (the mean) and is in
    the buckets from then on."""
    def make() -> nn.Module:
        model = Net(FEW)
        model.offset = nn.Parameter(torch.zeros(3), requires_grad=False)
        return model

    def loss(seed):
        x, y = _batch(seed)
        return lambda m: F.mse_loss(m(x) + m.offset, y)

    r = rig(way)
    model = make()
    r.enroll(model)
    trainable = sum(1 for p in model.parameters() if p.requires_grad)
    assert r.sync.parameters_in_buckets == trainable
    model.trunk[0].weight.requires_grad_(False)
    expected = _step(r, make, model, loss(0), loss(100))
    assert expected["offset"] is None and expected["trunk.0.weight"] is None
    assert_grads(model, expected)
    if not way.reads_gradients:  # the frozen weight's flag is 0; the parameter created frozen has none
        (launch,) = r.transport.launches
        assert [launch.flag(p) for p in model.parameters() if p is not model.offset] == [False] + [True] * 7
        assert id(model.offset) not in launch.params
    model.offset.requires_grad_(True)
    for step in (1, 2):
        expected = _step(r, make, model, loss(step), loss(100 + step))
        assert expected["offset"] is not None
        assert_grads(model, expected)
    assert r.sync.parameters_in_buckets == trainable + 1
    assert r.control.operations.count("gradient all-reduce") == 1  # the one-by-one all-reduce, once


def _embedding_model() -> nn.Module:
    return nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Flatten(), nn.Linear(8, 3))


def _ids_loss(seed: int, use_embedding: bool = True):
    g = torch.Generator().manual_seed(seed)
    ids, y = torch.randint(0, 10, (6, 2), generator=g), torch.randn(6, 3, generator=g)

    def loss(model: nn.Module) -> torch.Tensor:
        h = model[0](ids) if use_embedding else model[0].weight[ids].detach()  # detached: no gradient for it
        return F.mse_loss(model[2](model[1](h)), y)

    return loss


def _dense_embedding_model() -> nn.Module:
    model = _embedding_model()
    model[0].sparse = False
    return model


@pytest.mark.parametrize("way", WAYS, ids=str)
def test_a_sparse_gradient_is_summed_apart_and_leaves_its_bucket_slot_empty(way):
    """``nn.Embedding(sparse=True)``: its gradient is summed by the sparse all-reduce (and
    divided for MEAN), stays sparse, and its slot in the bucket carries nothing (flag 0)."""
    r = rig(way)
    model = _embedding_model()
    r.enroll(model)
    for step in range(STEPS):
        assert_grads(model, _step(r, _embedding_model, model, _ids_loss(step), _ids_loss(100 + step)))
        assert model[0].weight.grad.is_sparse
    assert r.peer.sparse_calls == STEPS
    if not way.reads_gradients:
        for launch in r.transport.launches:
            assert [launch.flag(p) for p in model.parameters()] == [False, True, True]
            assert [launch.sparse_flag(p) for p in model.parameters()] == [True, False, False]


_NO_FLAGS_UNDER_POWERSGD = pytest.mark.xfail(strict=True, reason=(
    "PowerSGD reduces the gradients themselves and carries no flags: a worker that computed no "
    "gradient for a parameter sends zeros in its place and cannot learn that a peer's was sparse, so "
    "with real processes the peer's sparse all-gather meets this worker's PowerSGD reduction"))


@pytest.mark.parametrize("way", [pytest.param(w, marks=_NO_FLAGS_UNDER_POWERSGD) if w.reads_gradients else w
                                 for w in WAYS], ids=str)
def test_a_sparse_gradient_only_the_peer_computed_gets_its_share(way):
    r = rig(way)
    model = _embedding_model()
    r.enroll(model)
    assert_grads(model, _step(r, _embedding_model, model, _ids_loss(0), _ids_loss(100)))  # both: it is sparse
    expected = _step(r, _embedding_model, model, _ids_loss(1, use_embedding=False), _ids_loss(101))
    assert r.peer.sparse_calls == 2, "this worker skipped the sparse all-gather its peer makes"
    assert_grads(model, expected)
    assert model[0].weight.grad.is_sparse  # the peer's rows, halved (MEAN), as the peer gets them


@pytest.mark.parametrize("way", [w for w in WAYS if not w.reads_gradients], ids=str)
def test_a_sparse_gradient_only_this_worker_computed_is_summed_with_the_peers_none(way):
    """The mirror case: the peer computed none (its flag 0), this worker's is sparse (-1): the sum
    is this worker's own rows, halved for MEAN."""
    r = rig(way)
    model = _embedding_model()
    r.enroll(model)
    assert_grads(model, _step(r, _embedding_model, model, _ids_loss(0), _ids_loss(100)))
    expected = _step(r, _embedding_model, model, _ids_loss(1), _ids_loss(101, use_embedding=False))
    assert r.peer.sparse_calls == 2
    assert_grads(model, expected)


@pytest.mark.parametrize("way", WAYS, ids=str)
def test_a_gradient_that_was_sparse_and_is_dense_now_is_reduced(way):
    r = rig(way)
    model = _embedding_model()
    r.enroll(model)
    assert_grads(model, _step(r, _embedding_model, model, _ids_loss(0), _ids_loss(100)))
    model[0].sparse = False
    assert_grads(model, _step(r, _dense_embedding_model, model, _ids_loss(1), _ids_loss(101)))


@pytest.mark.parametrize("layers", [FEW, MANY], ids=["8_grads", "18_grads"])
@pytest.mark.parametrize("way", WAYS, ids=str)
def test_no_sync_accumulates_locally_and_the_next_backward_reduces_the_sum(way, layers):
    """Inside ``no_sync()`` nothing is launched and the gradients are this worker's own,
    undivided; the next backward outside reduces what both workers accumulated."""
    r = rig(way)
    model = Net(layers)
    r.enroll(model)
    make = lambda: Net(layers)  # noqa: E731
    assert_grads(model, _step(r, make, model, _loss(0), _loss(100)))  # a step first: slots, views in place
    launched = len(r.transport.launches)
    copy = twin(make, model)
    first, second = autograd_grads(copy, _loss(1)), autograd_grads(copy, _loss(2))
    peer_first, peer_second = autograd_grads(copy, _loss(101)), autograd_grads(copy, _loss(102))
    model.zero_grad(set_to_none=True)
    with r.sync.no_sync():
        _loss(1)(model).backward()
    assert len(r.transport.launches) == launched and r.transport.finished == 1
    assert_grads(model, first)
    peer = combined(peer_first, peer_second, 1)
    r.peer.set({p: peer[name] for name, p in model.named_parameters()})
    _loss(2)(model).backward()
    assert_grads(model, combined(combined(first, second, 1), peer, 2))
    assert r.transport.finished == 2


def test_a_step_inside_no_sync_is_refused_through_the_optimizer_step_hook():
    """``opt.step()`` reaches the synchroniser's ``pre_step`` through the step hooks: inside
    ``no_sync()`` the gradients were never reduced, so the step is refused."""
    r = rig(ALL_REDUCE)
    model = Net(FEW)
    r.enroll(model)
    for p in model.parameters():
        attach(p, r.sync)
    install_step_hooks()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    with r.sync.no_sync():
        _loss(0)(model).backward()
        with pytest.raises(GradientSyncError, match="no_sync"):
            opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


@pytest.mark.parametrize("way", WAYS, ids=str)
def test_training_with_opt_step_matches_one_device_on_both_workers_batches(way):
    """``backward(); opt.step()`` (SGD with momentum, through the step hooks) trains as one
    device on the global batch: this worker's half and the peer's."""
    r = rig(way)
    model = Net(FEW)
    reference = Net(FEW)
    reference.load_state_dict(model.state_dict())
    r.enroll(model)
    for p in model.parameters():
        attach(p, r.sync)
    install_step_hooks()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    reference_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(5):
        (x, y), (px, py) = _batch(step), _batch(100 + step)
        _step(r, lambda: Net(FEW), model, _loss(step), _loss(100 + step))
        opt.step()
        reference_opt.zero_grad()
        F.mse_loss(reference(torch.cat([x, px])), torch.cat([y, py])).backward()
        reference_opt.step()
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got, want)


def test_views_hand_out_makes_each_gradient_a_view_of_the_reduced_flat():
    """Where the reduced flat is the bucket's own (an all-reduce over the group), each
    gradient becomes its view of it, and stays that very tensor through
    ``zero_grad(set_to_none=False)`` (autograd accumulates into the bucket)."""
    r = rig(ALL_REDUCE)
    model = Net(FEW)
    r.enroll(model)
    (bucket,) = r.transport.buckets
    for step in range(2):
        assert_grads(model, _step(r, lambda: Net(FEW), model, _loss(step), _loss(100 + step), set_to_none=False))
        for param, view in zip(bucket.params, bucket.views):
            assert param.grad is view
            assert param.grad.untyped_storage().data_ptr() == bucket.flat.untyped_storage().data_ptr()


@pytest.mark.parametrize("layers", [FEW, MANY], ids=["8_grads", "18_grads"])
@pytest.mark.parametrize("way", [SHARED_MEMORY, ACROSS_HOSTS], ids=str)
def test_copies_hand_out_never_aliases_the_shared_sums(way, layers):
    """Where the sums live in memory the workers share, each gradient is a copy: zeroing
    the gradients in place here (``zero_grad(set_to_none=False)``) leaves the shared sums
    as they were, which a peer still reads."""
    r = rig(way)
    model = Net(layers)
    r.enroll(model)
    for step in range(STEPS):
        assert_grads(model, _step(r, lambda: Net(layers), model, _loss(step), _loss(100 + step), set_to_none=False))
        (bucket,) = r.transport.buckets
        shared = r.transport.sums(bucket)
        kept = shared.clone()
        assert all(p.grad.untyped_storage().data_ptr() != shared.untyped_storage().data_ptr()
                   for p in model.parameters())
        model.zero_grad(set_to_none=False)
        assert torch.equal(shared, kept)


@pytest.mark.parametrize("way", WAYS, ids=str)
def test_buckets_leave_during_backward_only_where_the_transport_overlaps_it(way):
    """One parameter per bucket (1-byte buckets): over the group the first bucket is
    launched while backward still produces gradients; where every bucket is reduced when
    backward ends, every launch comes after the last gradient."""
    r = rig(way, bucket_bytes=1)
    model = Net(FEW)
    r.enroll(model)
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, name=name: r.peer.events.append(("grad", name)))
    _step(r, lambda: Net(FEW), model, _loss(0), _loss(100))
    kinds = [kind for kind, _ in r.peer.events]
    first_launch, last_grad = kinds.index("launch"), len(kinds) - 1 - kinds[::-1].index("grad")
    assert kinds.count("launch") == len(r.transport.buckets) == sum(1 for _ in model.parameters())
    assert (first_launch < last_grad) is way.overlaps_backward
