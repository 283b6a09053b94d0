"""CPU replicas reduce their gradients in place: the same results as the general reduction."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import unison
from unison.collectives.ops.local import ReductionToOneDevice
from unison.gradient_sync.replicas import replica_reduction


def _grads_after_backward(strategy, use_in_replica: "callable") -> list[list[torch.Tensor]]:
    """Each replica's gradients of a two-layer model after one backward pass (the second
    layer used only where ``use_in_replica(replica)`` says)."""
    with strategy.scope():
        torch.manual_seed(0)
        first, second = nn.Linear(4, 3), nn.Linear(3, 2)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    out = {}

    def step(batch):
        replica = unison.get_replica_context().replica_id_in_sync_group
        hidden = first(batch)
        loss = (second(hidden).sum() if use_in_replica(replica) else hidden.sum()) * (replica + 1)
        loss.backward()
        out[replica] = [p.grad.clone() for p in (*first.parameters(), *second.parameters())]

    strategy.run(step, args=(unison.PerReplica(list(x.chunk(2))),))
    return [out[0], out[1]]


def test_in_place_mean_equals_the_general_reduction():
    fast = unison.MirroredStrategy(["cpu:0", "cpu:1"])
    general = unison.MirroredStrategy(["cpu:0", "cpu:1"], cross_device_ops=ReductionToOneDevice(
        accumulation_fn=lambda tensors: sum(tensors[1:], tensors[0].clone())))
    assert fast.extended.components.gradient_sync.merge.in_place and not general.extended.components.gradient_sync.merge.in_place
    got = _grads_after_backward(fast, lambda replica: True)
    want = _grads_after_backward(general, lambda replica: True)
    for g, w in zip(got[0] + got[1], want[0] + want[1]):
        assert torch.equal(g, w)
    assert all(torch.equal(a, b) for a, b in zip(got[0], got[1]))  # every replica holds the mean


def test_a_parameter_without_gradient_in_one_replica_gets_the_mean_there_too():
    strategy = unison.MirroredStrategy(["cpu:0", "cpu:1"])
    grads = _grads_after_backward(strategy, lambda replica: replica == 1)
    for a, b in zip(grads[0], grads[1]):
        assert torch.equal(a, b)
    assert grads[0][2].abs().sum() > 0  # replica 1's gradient of the second layer, halved, reached replica 0


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


def _large_grads_after_backward(strategy, replicas: int) -> list[list[torch.Tensor]]:
    with strategy.scope():
        model = _LargeAndSmall()
    x = torch.randn(6 * replicas, 600, generator=torch.Generator().manual_seed(1))
    out = {}

    def step(batch):
        replica = unison.get_replica_context().replica_id_in_sync_group
        (model(batch).sum() * (replica + 1)).backward()
        out[replica] = [p.grad.clone() for p in model.parameters()]  # right after backward: every slice written

    strategy.run(step, args=(unison.PerReplica(list(x.chunk(replicas))),))
    return [out[r] for r in range(replicas)]


@pytest.mark.parametrize("replicas", [2, 3])
@pytest.mark.parametrize("reduce_op", ["mean", "sum"])
def test_large_gradients_reduced_in_slices_by_every_replica_equal_the_general_reduction(replicas, reduce_op,
                                                                                        monkeypatch):
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
    want = _large_grads_after_backward(general, replicas)
    for r in range(replicas):
        for g, w in zip(got[r], want[r]):
            assert torch.equal(g, w)  # the same arithmetic, bit for bit
        assert all(torch.equal(a, b) for a, b in zip(got[r], got[0]))
