"""Optimizer integration: plain ``opt.step()`` inside ``run``, per-device state, accumulation, misuse."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import unison
from tests.strategies._training import (
    batches,
    loss_fn,
    make_mlp,
    max_abs_diff,
    replicas_identical,
    split,
    train_plain,
    train_strategy,
)

pytestmark = pytest.mark.timeout(60)


def sgd_momentum(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _shadow_optimizers(strategy, opt):
    # White-box: the optimizers that step replicas 1.. (the user's one steps replica 0).
    return strategy.extended.components.gradient_sync.optimizers._shadows[opt]


def test_optimizer_state_is_per_device(mirrored2):
    model, opt = train_strategy(mirrored2, sgd_momentum, data=batches(steps=3))
    params = list(model.parameters())
    # the user's optimizer holds replica 0's state, keyed by the variables themselves
    assert set(map(id, opt.state)) == set(map(id, params))
    assert all(isinstance(p, unison.MirroredVariable) for p in opt.state)
    (shadow,) = _shadow_optimizers(mirrored2, opt)
    assert shadow is not opt
    for p in params:
        first, second = p.values
        mine = opt.state[p]["momentum_buffer"]
        theirs = shadow.state[p.component(1)]["momentum_buffer"]
        assert mine.data_ptr() != theirs.data_ptr()  # each device has its own buffer
        assert torch.equal(mine, theirs)  # and the replicas stay identical
        assert torch.equal(first, second)
    state = opt.state_dict()
    assert sorted(state["state"]) == list(range(len(params)))
    assert all(type(s["momentum_buffer"]) is torch.Tensor for s in state["state"].values())


def test_optimizer_state_dict_matches_single_device(mirrored2):
    _, opt = train_strategy(mirrored2, sgd_momentum)
    model2 = make_mlp()
    opt2 = sgd_momentum(model2.parameters())
    for x, y in batches():
        opt2.zero_grad()
        loss_fn(model2, x, y).backward()
        opt2.step()
    mine, plain = opt.state_dict(), opt2.state_dict()
    assert mine["param_groups"] == plain["param_groups"]
    assert sorted(mine["state"]) == sorted(plain["state"])
    for k, state in mine["state"].items():
        assert torch.allclose(state["momentum_buffer"], plain["state"][k]["momentum_buffer"], atol=1e-5)


def test_hyperparameter_changes_reach_every_replica(mirrored2):
    with mirrored2.scope():
        model = make_mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
    reference = make_mlp()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    for step_index, (x, y) in enumerate(batches(steps=4)):
        lr = 0.05 if step_index < 2 else 0.5
        for group in (opt.param_groups[0], ref_opt.param_groups[0]):
            group["lr"] = lr

        def step(x, y):
            opt.zero_grad()
            loss_fn(model, x, y).backward()
            opt.step()

        mirrored2.run(step, args=(split(mirrored2, x), split(mirrored2, y)))
        ref_opt.zero_grad()
        loss_fn(reference, x, y).backward()
        ref_opt.step()
    assert max_abs_diff(mirrored2, model, reference) <= 1e-5
    assert replicas_identical(mirrored2, model)


@pytest.mark.parametrize("make", [lambda: unison.MirroredStrategy(["cpu:0", "cpu:1"]),
                                  lambda: unison.CentralStorageStrategy(["cpu:0", "cpu:1"])],
                         ids=["mirrored", "central_storage"])
def test_gradient_accumulation_over_two_backward_calls(make):
    strategy = make()
    data = batches(steps=6)
    with strategy.scope():
        model = make_mlp()
        opt = sgd_momentum(model.parameters())

    def step(x1, y1, x2, y2):
        opt.zero_grad()
        loss_fn(model, x1, y1).backward()
        loss_fn(model, x2, y2).backward()  # accumulates into the same .grad
        opt.step()

    reference = make_mlp()
    ref_opt = sgd_momentum(reference.parameters())
    for (xa, ya), (xb, yb) in zip(data[::2], data[1::2]):
        strategy.run(step, args=tuple(split(strategy, t) for t in (xa, ya, xb, yb)))
        ref_opt.zero_grad()
        loss_fn(reference, xa, ya).backward()
        loss_fn(reference, xb, yb).backward()
        ref_opt.step()
    assert max_abs_diff(strategy, model, reference) <= 1e-5
    assert replicas_identical(strategy, model)


@pytest.mark.parametrize("make", [lambda: unison.MirroredStrategy(["cpu:0", "cpu:1"]),
                                  lambda: unison.CentralStorageStrategy(["cpu:0", "cpu:1"])],
                         ids=["mirrored", "central_storage"])
@pytest.mark.parametrize("zero", ["optimizer", "module"])
def test_zero_grad_between_steps_outside_run(make, zero):
    # ``opt.zero_grad()`` in cross-replica context must clear every replica's gradient,
    # else replica 1 accumulates onto the previous step's gradient.
    strategy = make()
    with strategy.scope():
        model = make_mlp()
        opt = sgd_momentum(model.parameters())

    def step(x, y):
        loss_fn(model, x, y).backward()
        opt.step()

    for x, y in batches(steps=5):
        (opt if zero == "optimizer" else model).zero_grad()
        strategy.run(step, args=(split(strategy, x), split(strategy, y)))
    assert max_abs_diff(strategy, model, train_plain(sgd_momentum, data=batches(steps=5))) <= 1e-5


def test_grad_assignment_in_cross_replica_context_reaches_every_replica(mirrored2):
    with mirrored2.scope():
        layer = nn.Linear(2, 1, bias=False)
    layer.weight.grad = torch.ones(1, 2)
    grads = [layer.weight.component_grad(i) for i in range(2)]
    assert [g.tolist() for g in grads] == [[[1.0, 1.0]]] * 2
    assert grads[0].data_ptr() != grads[1].data_ptr()  # each replica accumulates into its own
    layer.weight.grad = None
    assert [layer.weight.component_grad(i) for i in range(2)] == [None, None]


def test_zero_grad_keep_tensors_outside_run(mirrored2):
    with mirrored2.scope():
        model = make_mlp()
        opt = sgd_momentum(model.parameters())

    def step(x, y):
        loss_fn(model, x, y).backward()
        opt.step()

    for x, y in batches(steps=3):
        opt.zero_grad(set_to_none=False)
        mirrored2.run(step, args=(split(mirrored2, x), split(mirrored2, y)))
    assert max_abs_diff(mirrored2, model, train_plain(sgd_momentum, data=batches(steps=3))) <= 1e-5


@pytest.mark.parametrize("make", [lambda: unison.MirroredStrategy(["cpu:0", "cpu:1"]),
                                  lambda: unison.CentralStorageStrategy(["cpu:0", "cpu:1"])],
                         ids=["mirrored", "central_storage"])
def test_step_outside_run_raises(make):
    strategy = make()
    with strategy.scope():
        model = nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [c.clone() for c in model.weight.values]
    model(torch.ones(2, 3)).sum().backward()
    name = type(strategy).__name__
    with pytest.raises(RuntimeError, match=rf"opt.step\(\) on a model of {name} with 2 local replicas must run inside "
                                           r"strategy.run\(step_fn\)"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.weight.values))  # nothing was updated


def test_step_outside_run_under_one_device_is_plain(one_device):
    with one_device.scope():
        model = nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.weight.detach().clone()
    model(torch.ones(2, 3)).sum().backward()
    opt.step()  # one replica: no aggregation needed, a plain step
    assert not torch.equal(before, model.weight.detach())


def test_step_inside_run_of_another_strategy_raises(mirrored2):
    with mirrored2.scope():
        model = nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    other = unison.MirroredStrategy(["cpu:0", "cpu:1"])
    with pytest.raises(RuntimeError, match=r"must run inside strategy.run"):
        other.run(lambda: opt.step())


def test_plain_optimizer_unaffected_by_hooks(mirrored2):
    with mirrored2.scope():
        pass  # installs the process-wide hooks
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(2, 3)).sum().backward()
    before = model.weight.detach().clone()
    opt.step()
    assert torch.allclose(model.weight.detach(), before - 0.1 * 2 * torch.ones(1, 3))


def test_parameters_without_gradient_are_skipped(mirrored2):
    with mirrored2.scope():
        used, unused = nn.Linear(2, 1), nn.Linear(2, 1)
        opt = torch.optim.SGD([*used.parameters(), *unused.parameters()], lr=0.1, momentum=0.9)
    before = [c.clone() for c in unused.weight.values]

    def step(x):
        opt.zero_grad()
        used(x).sum().backward()
        opt.step()

    mirrored2.run(step, args=(unison.PerReplica([torch.ones(1, 2), torch.ones(1, 2)]),))
    assert all(torch.equal(a, b) for a, b in zip(before, unused.weight.values))
    assert torch.equal(*used.weight.values)
