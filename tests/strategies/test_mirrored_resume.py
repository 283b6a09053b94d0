"""Resuming a MirroredStrategy model from a checkpoint continues exactly.

Every replica applies the same reduced gradients, so every replica's optimizer state
equals replica 0's (the user's optimizer's). A restored optimizer state must therefore
reach the other replicas' shadow optimizers too: with fresh shadows, their momentum
(or Adam moments) would restart from zero and the replicas' weights would part.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import unison

pytestmark = pytest.mark.timeout(60)

OPTIMIZERS = {
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
}


def _build(make_optimizer):
    strategy = unison.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        optimizer = make_optimizer(model.parameters())
    return strategy, model, optimizer


def _train(strategy, model, optimizer, batches):
    def fn(batch):
        x, y = batch
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()

    for x, y in batches:
        strategy.run(fn, args=(unison.PerReplica([(x[:4], y[:4]), (x[4:], y[4:])]),))


def _components(model):
    return [[c.clone() for c in p.values] for p in model.parameters()]


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("stepped_before_restore", [False, True], ids=["fresh", "stepped"])
def test_restored_optimizer_state_reaches_every_replica(name, stepped_before_restore):
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(6)]
    strategy, model, optimizer = _build(OPTIMIZERS[name])
    _train(strategy, model, optimizer, batches[:3])
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_optimizer = copy.deepcopy(optimizer.state_dict())  # as a checkpoint file holds it
    _train(strategy, model, optimizer, batches[3:])
    uninterrupted = _components(model)

    strategy2, model2, optimizer2 = _build(OPTIMIZERS[name])
    if stepped_before_restore:  # the replicas' shadows exist already, with other state
        _train(strategy2, model2, optimizer2, batches[4:])
    model2.load_state_dict(saved_model)
    optimizer2.load_state_dict(saved_optimizer)
    _train(strategy2, model2, optimizer2, batches[3:])
    for got, want in zip(_components(model2), uninterrupted):
        for g_component, w_component in zip(got, want):
            torch.testing.assert_close(g_component, w_component, rtol=0, atol=1e-6)
