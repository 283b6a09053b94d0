"""Lazy modules (nn.LazyLinear, LazyBatchNorm) built in a strategy's scope become its variables at the dry run.

Their uninitialised parameters used to reach the variable policy, which failed on them
(``Attempted to use an uninitialized parameter``) under every strategy that copies or
mirrors parameters.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import unison
from unison.errors import UsageError

pytestmark = pytest.mark.timeout(60)

STRATEGIES = {
    "mirrored": (lambda: unison.MirroredStrategy(["cpu:0", "cpu:1"]), 2),
    "central_storage": (lambda: unison.CentralStorageStrategy(["cpu:0", "cpu:1"]), 2),
    "one_device": (lambda: unison.OneDeviceStrategy("cpu:0"), 1),
}


def _data(steps: int = 6):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)) for _ in range(steps)]


def _lazy_model() -> nn.Module:
    return nn.Sequential(nn.LazyLinear(16), nn.Tanh(), nn.LazyLinear(4))


def _train(strategy, replicas: int, dry_run: str):
    """``dry_run``: "in_scope", "after_scope" (cross-replica either way) or "in_run"."""
    torch.manual_seed(0)
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = _lazy_model()
        if dry_run == "in_scope":
            model(torch.zeros(1, 8))
    if dry_run == "after_scope":
        model(torch.zeros(1, 8))
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(x, y):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    for x, y in _data():
        if strategy is None:
            step(x, y)
        else:
            args = (x, y) if replicas == 1 else tuple(unison.PerReplica(list(t.chunk(replicas))) for t in (x, y))
            strategy.run(step, args=args)
    return model


@pytest.mark.parametrize("dry_run", ["in_scope", "after_scope"])
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_a_lazy_model_trains_as_on_one_device(name, dry_run):
    reference = _train(None, 1, "in_scope")
    factory, replicas = STRATEGIES[name]
    model = _train(factory(), replicas, dry_run)
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-5, atol=1e-6)
    if replicas > 1:
        assert all(isinstance(p, unison.MirroredVariable) for p in model.parameters())
    for layer in (model[0], model[2]):
        assert not layer._forward_pre_hooks  # PyTorch's and unison's hooks are gone after the dry run
        assert type(layer) is nn.Linear


def test_lazy_buffers_become_the_strategys_too():
    strategy = unison.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        eager = nn.BatchNorm1d(8)
        lazy = nn.LazyBatchNorm1d()
        lazy(torch.randn(4, 8))
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        assert type(getattr(lazy, name)) is type(getattr(eager, name))
    assert isinstance(lazy.weight, unison.MirroredVariable)
    assert set(lazy.state_dict()) == set(eager.state_dict())


def test_a_first_call_inside_run_with_several_replicas_is_refused_before_anything_is_drawn():
    strategy = unison.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = _lazy_model()
    with pytest.raises(UsageError, match=r"LazyLinear was first called inside strategy.run .* 2 replicas.*"
                                           r"model\(example_batch\)"):
        strategy.run(model, args=(unison.PerReplica([torch.zeros(2, 8), torch.zeros(2, 8)]),))
    assert all(nn.parameter.is_lazy(p) for p in model.parameters())
    model(torch.zeros(1, 8))  # the dry run the message asks for
    assert all(isinstance(p, unison.MirroredVariable) for p in model.parameters())


def test_one_replica_may_initialise_inside_run():
    torch.manual_seed(0)
    expected = _lazy_model()
    expected(torch.zeros(1, 8))
    strategy = unison.OneDeviceStrategy("cpu:0")
    torch.manual_seed(0)
    with strategy.scope():
        model = _lazy_model()
    strategy.run(model, args=(torch.zeros(1, 8),))
    for got, want in zip(model.parameters(), expected.parameters()):
        assert torch.equal(got.detach(), want.detach())
