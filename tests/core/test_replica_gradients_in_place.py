"""CPU replicas reduce their gradients in place: the same results as the general reduction."""

from __future__ import annotations

import torch
from torch import nn

import unison
from unison.collectives.local import ReductionToOneDevice


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
    assert fast.extended.components.gradient_sync._in_place and not general.extended.components.gradient_sync._in_place
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
