"""CPU replicas reduce their gradients in place: the same results as the general reduction
and as plain autograd on each replica's part of the batch, summed or averaged."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

import unison
from unison._collectives.ops import in_place_reduction as replica_reduction
from unison._collectives.ops.local import ReductionToOneDevice
from unison._gradient_sync.replicas import replica_grad_buffers


def _plain_reduced(model: nn.Module, parts: list[torch.Tensor], loss: Callable, reduce_op: str = "mean"
                   ) -> list[torch.Tensor]:
    """The oracle, in plain PyTorch: replica ``r``'s gradients are a copy of ``model``'s after
    ``loss(copy, parts[r], r).backward()``; their sum, or mean, parameter by parameter, with
    zeros where a replica computed no gradient."""
    per_replica = []
    for replica, part in enumerate(parts):
        here = copy.deepcopy(model)
        loss(here, part, replica).backward()
        per_replica.append([torch.zeros_like(p) if p.grad is None else p.grad for p in here.parameters()])
    total = [sum(grads[1:], grads[0].clone()) for grads in zip(*per_replica)]
    return [t / len(parts) for t in total] if reduce_op == "mean" else total


def _two_layers() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))


def _two_layer_loss(use_in_replica: Callable[[int], bool]) -> Callable:
    """Replica ``r``'s loss, scaled by ``r + 1`` (so the replicas differ); the second layer
    used only where ``use_in_replica(r)`` says."""
    def loss(model: nn.Module, batch: torch.Tensor, replica: int) -> torch.Tensor:
        hidden = model[0](batch)
        return (model[1](hidden).sum() if use_in_replica(replica) else hidden.sum()) * (replica + 1)
    return loss


def _two_layer_batch() -> list[torch.Tensor]:
    return list(torch.randn(6, 4, generator=torch.Generator().manual_seed(1)).chunk(2))


def _grads_after_backward(strategy, use_in_replica: callable) -> list[list[torch.Tensor]]:
    """Each replica's gradients of a two-layer model after one backward pass (the second
    layer used only where ``use_in_replica(replica)`` says)."""
    with strategy.scope():
        model = _two_layers()
    loss = _two_layer_loss(use_in_replica)
    out = {}

    def step(batch):
        replica = unison.get_replica_context().replica_id_in_sync_group
        loss(model, batch, replica).backward()
        out[replica] = [p.grad.clone() for p in model.parameters()]

    strategy.run(step, args=(unison.PerReplica(_two_layer_batch()),))
    return [out[0], out[1]]


def _record_in_place_groups(monkeypatch) -> list[int]:
    """Records the elements of each gradient (or flat buffer) added to an in-place reduction."""
    added: list[int] = []
    original = replica_reduction.InPlaceReduction.add

    def recording(self, per_replica):
        added.append(per_replica[0].numel())
        return original(self, per_replica)

    monkeypatch.setattr(replica_reduction.InPlaceReduction, "add", recording)
    return added


def test_in_place_mean_equals_the_general_reduction_and_plain_autograd(monkeypatch):
    fast = unison.MirroredStrategy(["cpu:0", "cpu:1"])
    general = unison.MirroredStrategy(["cpu:0", "cpu:1"], cross_device_ops=ReductionToOneDevice(
        accumulation_fn=lambda tensors: sum(tensors[1:], tensors[0].clone())))
    assert (fast.extended.components.gradient_sync.merge.in_place
            and not general.extended.components.gradient_sync.merge.in_place)
    added = _record_in_place_groups(monkeypatch)
    got = _grads_after_backward(fast, lambda replica: True)
    assert added == [12, 3, 6, 2]  # the in-place path, a gradient at a time (4 gradients: no buffers)
    want = _grads_after_backward(general, lambda replica: True)
    for g, w in zip(got[0] + got[1], want[0] + want[1]):
        assert torch.equal(g, w)
    plain = _plain_reduced(_two_layers(), _two_layer_batch(), _two_layer_loss(lambda replica: True))
    for replica in (0, 1):  # every replica holds the mean of plain autograd's gradients on the halves
        for g, p in zip(got[replica], plain):
            torch.testing.assert_close(g, p)
    assert all(torch.equal(a, b) for a, b in zip(got[0], got[1]))


@pytest.mark.parametrize("buffers", [False, True])
def test_a_parameter_without_gradient_in_one_replica_gets_the_mean_there_too(buffers, monkeypatch):
    """Replica 0 does not use the second layer: under MEAN both replicas get half of
    replica 1's gradient of it (with the flat buffers too: a slot one replica never wrote)."""
    if buffers:
        monkeypatch.setattr(replica_grad_buffers, "MIN_GRADIENTS", 1)
    added = _record_in_place_groups(monkeypatch)
    strategy = unison.MirroredStrategy(["cpu:0", "cpu:1"])
    use = lambda replica: replica == 1  # noqa: E731
    grads = _grads_after_backward(strategy, use)
    assert added == ([23] if buffers else [12, 3, 6, 2])  # one flat buffer, or a gradient at a time
    plain = _plain_reduced(_two_layers(), _two_layer_batch(), _two_layer_loss(use))
    model = _two_layers()
    _two_layer_loss(use)(model, _two_layer_batch()[1], 1).backward()
    halved = [p.grad / 2 for p in model[1].parameters()]  # replica 1's own gradient of the second layer
    for replica in (0, 1):
        for g, p in zip(grads[replica], plain):
            torch.testing.assert_close(g, p)
        for g, h in zip(grads[replica][2:], halved):
            torch.testing.assert_close(g, h)
    assert all(torch.equal(a, b) for a, b in zip(grads[0], grads[1]))


class _LargeAndSmall(nn.Module):
    """A layer of 300,500 parameters (past SPLIT_MIN_ELEMENTS) and 40 small ones (the flat buffers)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.large = nn.Linear(600, 500)
        self.small = nn.Sequential(*[nn.Linear(500, 1) for _ in range(20)])

    def forward(self, x):
        hidden = torch.tanh(self.large(x))
        return sum(layer(hidden) for layer in self.small)


def _large_loss(model: nn.Module, batch: torch.Tensor, replica: int) -> torch.Tensor:
    return model(batch).sum() * (replica + 1)


def _large_batch(replicas: int) -> list[torch.Tensor]:
    return list(torch.randn(6 * replicas, 600, generator=torch.Generator().manual_seed(1)).chunk(replicas))


def _large_grads_after_backward(strategy, replicas: int) -> list[list[torch.Tensor]]:
    with strategy.scope():
        model = _LargeAndSmall()
    out = {}

    def step(batch):
        replica = unison.get_replica_context().replica_id_in_sync_group
        _large_loss(model, batch, replica).backward()
        out[replica] = [p.grad.clone() for p in model.parameters()]  # right after backward: every slice written

    strategy.run(step, args=(unison.PerReplica(_large_batch(replicas)),))
    return [out[r] for r in range(replicas)]


@pytest.mark.parametrize("replicas", [2, 3])
@pytest.mark.parametrize("reduce_op", ["mean", "sum"])
def test_large_gradients_reduced_in_slices_by_every_replica_equal_plain_autograd(replicas, reduce_op, monkeypatch):
    devices = [f"cpu:{i}" for i in range(replicas)]
    fast = unison.MirroredStrategy(devices)
    general = unison.MirroredStrategy(devices, cross_device_ops=ReductionToOneDevice(
        accumulation_fn=lambda tensors: sum(tensors[1:], tensors[0].clone())))
    for strategy in (fast, general):
        strategy.extended.gradient_reduce_op = unison.ReduceOp.from_any(reduce_op)
    sliced_by = []
    original = replica_reduction.InPlaceReduction.run

    def recording(self, replica_id=None):
        sliced_by.append(replica_id)
        return original(self, replica_id)

    monkeypatch.setattr(replica_reduction.InPlaceReduction, "run", recording)
    got = _large_grads_after_backward(fast, replicas)
    assert sorted(sliced_by) == list(range(replicas))  # one slice each, the small buffers' with them
    assert len(fast.extended.components.gradient_sync.merge.buffers._replicas) == replicas  # 40 small: in buffers
    want = _large_grads_after_backward(general, replicas)
    plain = _plain_reduced(_LargeAndSmall(), _large_batch(replicas), _large_loss, reduce_op)
    for r in range(replicas):
        for g, w in zip(got[r], want[r]):
            assert torch.equal(g, w)  # the same arithmetic, bit for bit
        for g, p in zip(got[r], plain):
            torch.testing.assert_close(g, p)
        assert all(torch.equal(a, b) for a, b in zip(got[r], got[0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("replicas", [2, 3, 4])
def test_the_mean_in_place_is_the_sum_divided_bit_for_bit(dtype, replicas):
    """Every replica's tensor ends as (t0 + t1 + ...) / n, added in replica order, to the bit:
    with the subnormal, smallest normal and largest values of the dtype, whatever the
    multiplier the reduction uses for a power of two."""
    info = torch.finfo(dtype)
    edges = torch.tensor([info.tiny * f for f in (0.5, 0.25, 0.75, 1.5, 3.0)]
                         + [info.max / replicas, -info.max / replicas, info.smallest_normal], dtype=dtype)
    generator = torch.Generator().manual_seed(replicas)
    per_replica = [[torch.cat([edges, (torch.randn(64, generator=generator) * 2.0 ** -r).to(dtype)]),
                    (torch.randn(3, 5, generator=generator) * info.tiny * 8).to(dtype)] for r in range(replicas)]
    expected = []
    for k in range(2):
        total = per_replica[0][k].clone()
        for tensors in per_replica[1:]:
            total = total + tensors[k]
        expected.append(total / replicas)
    reduction = replica_reduction.InPlaceReduction(replicas, mean=True)
    for k in range(2):
        reduction.add([tensors[k] for tensors in per_replica])
    reduction.run()
    for tensors in per_replica:
        for got, want in zip(tensors, expected, strict=True):
            assert got.dtype == dtype
            assert torch.equal(got.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8))
