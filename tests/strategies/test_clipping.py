"""Code between backward() and opt.step() sees gradients reduced across replicas."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import unison

pytestmark = pytest.mark.timeout(60)


def _make() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(64, 8, generator=g), torch.randint(0, 4, (64,), generator=g)) for _ in range(10)]


@pytest.mark.parametrize("strategy_factory", [
    lambda: unison.MirroredStrategy(["cpu:0", "cpu:1"]),
    lambda: unison.CentralStorageStrategy(["cpu:0", "cpu:1"]),
])
def test_clip_grad_norm_between_backward_and_step_matches_single_device(strategy_factory):
    reference = _make()
    opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for x, y in _data():
        opt.zero_grad()
        nn.functional.cross_entropy(reference(x), y).backward()
        nn.utils.clip_grad_norm_(reference.parameters(), 1e-2)  # clipping is active: norms are ~1
        opt.step()

    strategy = strategy_factory()
    with strategy.scope():
        model = _make()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)

    def step(x, y):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1e-2)
        opt.step()

    for x, y in _data():
        strategy.run(step, args=(unison.PerReplica(list(x.chunk(2))), unison.PerReplica(list(y.chunk(2)))))
    for got, want in zip(model.parameters(), reference.parameters()):
        assert (got.detach() - want.detach()).abs().max().item() <= 1e-6


def test_step_inside_no_sync_is_refused():
    strategy = unison.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x):
        with strategy.extended.no_sync():
            model(x).sum().backward()
            opt.step()

    with pytest.raises(RuntimeError, match=r"opt.step\(\) inside `no_sync\(\)`"):
        strategy.run(step, args=(unison.PerReplica([torch.ones(1, 2), torch.ones(1, 2)]),))
