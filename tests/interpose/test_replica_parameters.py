"""Inside a replica a module's mirrored parameters are plain tensors (``_interpose/replica_parameters.py``).

A replica's step (forward, backward, ``zero_grad``, ``step``) makes no call to the
variables' ``__torch_function__``; everything that iterates a module still sees the
variables; gradients recorded in any context are component 0's, which is what
``var.grad`` reads.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import unison
from tests.strategies._training import assert_trains_as_on_one_device
from unison._values.variables import DistributedVariable

pytestmark = pytest.mark.timeout(60)


def _halves(x: torch.Tensor) -> unison.PerReplica:
    return unison.PerReplica([x[:2], x[2:]])


class _Tied(nn.Module):
    """Two layers sharing one weight (the same variable in two modules' parameters)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(3, 3)
        self.second = nn.Linear(3, 3)
        self.second.weight = self.first.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)))


def test_a_replica_reads_its_own_plain_component(mirrored2):
    with mirrored2.scope():
        model = nn.Linear(3, 2)
    seen = {}

    def fn():
        replica = unison.get_replica_context().replica_id_in_sync_group
        seen[replica] = model.weight

    mirrored2.run(fn)
    assert isinstance(model.weight, unison.MirroredVariable)  # cross-replica: the variable
    for replica in (0, 1):
        assert type(seen[replica]) is torch.Tensor and seen[replica] is model.weight.component(replica)
    assert all(isinstance(p, unison.MirroredVariable) for p in model.parameters())
    assert all(isinstance(v, torch.Tensor) for v in model.state_dict().values())


def test_a_replica_step_makes_no_dispatch(mirrored2, monkeypatch):
    with mirrored2.scope():
        model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def fn(batch):
        opt.zero_grad()
        model(batch).pow(2).mean().backward()
        opt.step()

    x = torch.randn(4, 3)
    mirrored2.run(fn, args=(_halves(x),))  # the first step makes the optimizers' shadows
    calls = []
    original = DistributedVariable.__torch_function__.__func__

    def counting(cls, func, types, args=(), kwargs=None):
        calls.append(getattr(func, "__name__", repr(func)))
        return original(cls, func, types, args, kwargs)

    monkeypatch.setattr(DistributedVariable, "__torch_function__", classmethod(counting))
    before = [p.detach().clone() for p in model.parameters()]
    calls.clear()
    mirrored2.run(fn, args=(_halves(x),))
    assert calls == []
    replica0, replica1 = zip(*(p.values for p in model.parameters()))
    assert all(not torch.equal(p, b) for p, b in zip(replica0, before))  # it stepped
    assert all(torch.equal(a, b) for a, b in zip(replica0, replica1))


def test_gradients_are_component_0s_in_every_context(mirrored2):
    with mirrored2.scope():
        model = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    model(x).sum().backward()  # cross-replica: recorded on component 0
    assert model.weight.grad is model.weight.component(0).grad
    assert torch.allclose(model.weight.grad, torch.ones(2, 1) * x.sum(0))
    model.zero_grad()
    assert model.weight.grad is None and model.weight.component(1).grad is None

    def fn(batch):
        model(batch).sum().backward()

    mirrored2.run(fn, args=(_halves(x),))
    assert model.weight.grad is model.weight.component(0).grad  # the reduced (mean) gradient
    assert torch.allclose(model.weight.grad, torch.ones(2, 1) * x.sum(0) / 2)
    assert torch.equal(model.weight.grad, model.weight.component(1).grad)


def test_tied_weights_train_as_on_one_device(mirrored2):
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))
    model = assert_trains_as_on_one_device(mirrored2, _Tied, x)
    assert model.second.weight is model.first.weight


def test_another_strategys_variable_is_returned_as_itself(mirrored2):
    other = unison.MirroredStrategy(["cpu:0", "cpu:1"])
    with other.scope():
        layer = nn.Linear(3, 2)
    seen = []
    mirrored2.run(lambda: seen.append(layer.weight))
    assert seen == [layer.weight, layer.weight] and all(isinstance(w, unison.MirroredVariable) for w in seen)


def test_pickles_hold_plain_dicts_and_deep_copies_hand_replicas_their_own_components(mirrored2):
    with mirrored2.scope():
        model = nn.Linear(3, 2)
    assert type(model._parameters).__name__ == "ReplicaParameters"
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert type(loaded._parameters) is dict and type(loaded.weight) is nn.Parameter
    torch.testing.assert_close(loaded.weight.detach(), model.weight.detach())
    # a deep copy's parameter dict hands each replica its own component of the copy's variables
    # (the variables themselves: tests/values/test_variables.py)
    duplicate = copy.deepcopy(model)
    assert type(duplicate._parameters).__name__ == "ReplicaParameters"
    seen = []
    mirrored2.run(lambda: seen.append(duplicate._parameters["weight"]))
    assert [s.data_ptr() for s in seen] == [c.data_ptr() for c in duplicate.weight.values]
