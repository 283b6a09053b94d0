"""A replica's gradient hook calls into the synchroniser once per backward pass, not per gradient."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import unison
from unison._gradient_sync.replicas.replica_sync import ReplicaGradientSync

pytestmark = pytest.mark.timeout(60)


def test_only_the_first_gradient_of_a_backward_pass_calls_into_the_synchroniser(mirrored2, monkeypatch):
    """The per-replica hook decides once per backward pass (autograd graph task); every
    backward pass still ends in a reduction."""
    with mirrored2.scope():
        model = nn.Sequential(*[nn.Linear(3, 3) for _ in range(5)])  # 10 gradients per replica
    calls = []
    original = ReplicaGradientSync._on_grad

    def counting(self, hook):
        calls.append(unison.get_replica_context().replica_id_in_sync_group)
        return original(self, hook)

    monkeypatch.setattr(ReplicaGradientSync, "_on_grad", counting)
    grads = {}

    def step(batch):
        replica = unison.get_replica_context().replica_id_in_sync_group
        for _ in range(2):  # two backward passes, each reduced: the sum of two means
            model(batch * (replica + 1)).sum().backward()
        grads[replica] = model[0].weight.grad.clone()

    mirrored2.run(step, args=(
        unison.PerReplica(list(torch.randn(4, 3, generator=torch.Generator().manual_seed(8)).chunk(2))),))
    assert sorted(calls) == [0, 0, 1, 1]
    assert torch.equal(grads[0], grads[1]) and grads[0].abs().sum() > 0
