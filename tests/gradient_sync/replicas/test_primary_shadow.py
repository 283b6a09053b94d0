"""Replica 0 steps the variables' plain component 0 (``_gradient_sync/replicas/first_replica_optimizer.py``).

The optimizer replica 0 steps sees plain tensors (no ``__torch_function__`` per
update), keeps its state in the user's optimizer keyed by the variables, follows the
optimizer's parameters when they change, and holds no gradient after a step.
"""

from __future__ import annotations

import gc
import importlib
import weakref

import pytest
import torch
from torch import nn

import unison
from unison._gradient_sync.replicas.first_replica_optimizer import PrimaryShadow

pytestmark = pytest.mark.timeout(60)


def _step(strategy, model, opt, x):
    def fn(batch):
        opt.zero_grad()
        model(batch).pow(2).mean().backward()
        opt.step()

    strategy.run(fn, args=(unison.PerReplica([x[:2], x[2:]]),))


def test_replica_0_steps_plain_tensors_with_the_users_state(mirrored2):
    with mirrored2.scope():
        model = nn.Linear(3, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    seen = []
    opt.register_step_pre_hook(lambda o, args, kwargs: None)  # user hooks still run on the user's optimizer
    sgd_module = importlib.import_module("torch.optim.sgd")
    original = sgd_module.sgd

    def spy(params, *args, **kwargs):  # the update SGD.step hands its parameters to
        seen.extend(type(p) for p in params)
        return original(params, *args, **kwargs)

    sgd_module.sgd = spy
    try:
        _step(mirrored2, model, opt, torch.randn(4, 3))
    finally:
        sgd_module.sgd = original
    assert seen and all(t is torch.Tensor for t in seen)  # no MirroredVariable reaches the update
    assert all(isinstance(p, unison.MirroredVariable) and "momentum_buffer" in opt.state[p] for p in model.parameters())


def test_aliases_follow_new_parameters(mirrored2):
    with mirrored2.scope():
        first, second = nn.Linear(3, 2), nn.Linear(3, 2)
        opt = torch.optim.SGD(first.parameters(), lr=0.1)
    x = torch.randn(4, 3)
    _step(mirrored2, first, opt, x)
    opt.add_param_group({"params": list(second.parameters())})
    before = [p.detach().clone() for p in second.parameters()]

    def fn(batch):
        opt.zero_grad()
        (first(batch) + second(batch)).pow(2).mean().backward()
        opt.step()

    mirrored2.run(fn, args=(unison.PerReplica([x[:2], x[2:]]),))
    for param, old in zip(second.parameters(), before):
        replica0, replica1 = param.values
        assert not torch.equal(replica0, old)  # replica 0 stepped the new group too
        assert torch.equal(replica0, replica1)


def test_replaced_data_and_requires_grad_reach_component_0(mirrored2):
    with mirrored2.scope():
        model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stepped = PrimaryShadow(opt).for_step(opt).param_groups[0]["params"][0]
    assert stepped is model.weight.component(0) and type(stepped) is torch.Tensor
    model.weight.data = torch.zeros(2, 2, dtype=torch.float64)  # cross-replica, through the variable
    model.weight.requires_grad_(False)
    with torch._C.DisableTorchFunctionSubclass():  # what C-level code reading the variable sees
        assert stepped.data_ptr() == model.weight.data_ptr() and stepped.dtype == torch.float64
        assert not model.weight.requires_grad and not stepped.requires_grad
    model.weight.requires_grad = True
    with torch._C.DisableTorchFunctionSubclass():
        assert model.weight.requires_grad and stepped.requires_grad


def test_no_gradient_is_kept_after_the_step(mirrored2):
    with mirrored2.scope():
        model = nn.Linear(3, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    refs = []

    def fn(batch):
        opt.zero_grad()
        model(batch).pow(2).mean().backward()
        opt.step()
        refs.append(weakref.ref(model.weight.grad))
        opt.zero_grad()  # set_to_none: nothing else may hold the gradient now

    mirrored2.run(fn, args=(unison.PerReplica([torch.randn(2, 3), torch.randn(2, 3)]),))
    gc.collect()
    assert len(refs) == 2 and all(ref() is None for ref in refs)
