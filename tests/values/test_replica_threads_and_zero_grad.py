"""Replicas share the intra-op threads, and ``zero_grad`` in a replica skips the dispatch.

- Each of ``n`` CPU replicas computes with ``threads // n`` intra-op threads (replica 0
  in the caller's thread only for the step): with every replica thread owning a full
  OpenMP team, libgomp sees more busy threads than CPUs and stops spinning at its
  barriers, which made even plain PyTorch in the same process 3x slower on small ops.
- After an optimizer of the strategy stepped, ``zero_grad()`` inside a replica sets the
  replica's own components' gradients to None without ``__torch_function__``; the
  other forms keep PyTorch's behaviour.
"""

from __future__ import annotations

import copy
import gc
import pickle
import threading
import weakref

import pytest
import torch
from torch import nn

import unison
from unison._values.dispatch import is_grad_access
from unison._values.variables import DistributedVariable

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def four_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    yield
    torch.set_num_threads(before)


def test_each_replica_computes_with_its_share_of_the_threads(four_threads):
    def counts(strategy):
        seen = {}

        def fn():
            seen[unison.get_replica_context().replica_id_in_sync_group] = torch.get_num_threads()

        for _ in range(2):  # the threads' first step, then a later one
            strategy.run(fn)
        return [seen[i] for i in sorted(seen)]

    assert counts(unison.MirroredStrategy(["cpu:0", "cpu:1"])) == [2, 2]
    assert torch.get_num_threads() == 4  # the caller's own count, back after the step
    assert counts(unison.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"])) == [1, 1, 1]
    assert torch.get_num_threads() == 4


def test_threads_started_after_the_replicas_keep_the_callers_count(four_threads):
    strategy = unison.MirroredStrategy(["cpu:0", "cpu:1"])
    strategy.run(lambda: None)
    seen = []
    later = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    later.start()
    later.join(10)
    assert seen == [4]


def test_the_caller_gets_its_thread_count_back_when_a_replica_raises(four_threads):
    strategy = unison.MirroredStrategy(["cpu:0", "cpu:1"])

    def fails():
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        strategy.run(fails)
    assert torch.get_num_threads() == 4


def _model_and_optimizer(strategy):
    with strategy.scope():
        model = nn.Linear(3, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, opt


def _train(strategy, model, opt, x, zero_first=True):
    def fn(batch):
        if zero_first:
            opt.zero_grad()
        model(batch).pow(2).mean().backward()
        opt.step()

    strategy.run(fn, args=(unison.PerReplica([x[:2], x[2:]]),))


def _component_grads(model):
    return [[p.component_grad(i) for i in range(len(p.values))] for p in model.parameters()]


def test_zero_grad_in_a_replica_clears_only_that_replicas_components_without_dispatch(mirrored2, monkeypatch):
    model, opt = _model_and_optimizer(mirrored2)
    _train(mirrored2, model, opt, torch.randn(4, 3))  # the first step installs the fast path
    assert "zero_grad" in vars(opt)
    assert all(g is not None for grads in _component_grads(model) for g in grads)
    calls = []
    original = DistributedVariable.__dict__["__torch_function__"].__func__

    def counting(cls, func, types, args=(), kwargs=None):
        if is_grad_access(func):
            calls.append(func)
        return original(cls, func, types, args, kwargs)

    monkeypatch.setattr(DistributedVariable, "__torch_function__", classmethod(counting))

    def zero_in_replica_1():
        if unison.get_replica_context().replica_id_in_sync_group == 1:
            opt.zero_grad()

    mirrored2.run(zero_in_replica_1)
    assert [[g is None for g in grads] for grads in _component_grads(model)] == [[False, True], [False, True]]
    mirrored2.run(lambda: opt.zero_grad())
    assert all(g is None for grads in _component_grads(model) for g in grads)
    assert not calls  # no .grad access went through a variable's __torch_function__


def test_training_with_the_fast_zero_grad_equals_single_device():
    torch.manual_seed(0)
    xs = [torch.randn(4, 3) for _ in range(4)]
    reference = nn.Linear(3, 2)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    strategy = unison.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = nn.Linear(3, 2)
        model.load_state_dict(reference.state_dict())
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x in xs:
        ref_opt.zero_grad()
        reference(x).pow(2).mean().backward()
        ref_opt.step()
        _train(strategy, model, opt, x)
    for got, want in zip(model.parameters(), reference.parameters()):
        for component in got.values:
            assert torch.allclose(component, want, atol=1e-6)


def test_other_zero_grad_forms_and_the_optimizers_life_are_unchanged(mirrored2):
    model, opt = _model_and_optimizer(mirrored2)
    x = torch.randn(4, 3)
    _train(mirrored2, model, opt, x)
    # set_to_none=False in a replica zeroes that replica's gradients in place (PyTorch's path)
    kept = _component_grads(model)
    # ruff sees the `del opt` below, but the lambda runs here, within run()
    mirrored2.run(lambda: opt.zero_grad(set_to_none=False))  # noqa: F821
    for before, after in zip(kept, _component_grads(model)):
        assert all(a is b and not a.any() for a, b in zip(after, before))
    # outside run: the cross-replica setter reaches every component
    opt.zero_grad()
    assert all(g is None for grads in _component_grads(model) for g in grads)
    # the replicas' shadow optimizers do not carry the user's instance's zero_grad
    _train(mirrored2, model, opt, x, zero_first=False)
    sync = mirrored2.extended.components.gradient_sync
    for shadows in sync.optimizers._shadows.values():
        assert all("zero_grad" not in vars(shadow) for shadow in shadows if shadow is not None)
    # copies and pickles carry the state, not the installed function
    assert "zero_grad" not in vars(copy.deepcopy(opt)) and "zero_grad" not in vars(pickle.loads(pickle.dumps(opt)))
    # the installed function holds the optimizer weakly: dropping the user's references frees it
    ref = weakref.ref(opt)
    del opt
    gc.collect()
    assert ref() is None


def test_the_fast_zero_grad_follows_a_parameter_group_added_later(mirrored2):
    model, opt = _model_and_optimizer(mirrored2)
    x = torch.randn(4, 3)
    _train(mirrored2, model, opt, x)
    mirrored2.run(lambda: opt.zero_grad())  # the components of the first group are known now
    with mirrored2.scope():
        head = nn.Linear(3, 2)
    opt.add_param_group({"params": list(head.parameters())})

    def fn(batch):
        (model(batch).pow(2).mean() + head(batch).pow(2).mean()).backward()

    mirrored2.run(fn, args=(unison.PerReplica([x[:2], x[2:]]),))
    assert all(g is not None for grads in _component_grads(head) for g in grads)
    mirrored2.run(lambda: opt.zero_grad())
    assert all(g is None for grads in _component_grads(model) + _component_grads(head) for g in grads)
