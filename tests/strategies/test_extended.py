"""StrategyExtended: update, value_container, variable_created_in_scope, device and role properties."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import unison
from unison import Mirrored, PerReplica, get_replica_context

pytestmark = pytest.mark.timeout(30)  # replicas are threads: a hung rendezvous fails the test


def test_update_group_true_gives_mirrored(mirrored2):
    with mirrored2.scope():
        v = unison.Variable([1.0, 2.0])
    out = mirrored2.extended.update(v, lambda c, x: c.add_(x), args=(torch.tensor([1.0, 1.0]),))
    assert isinstance(out, Mirrored)
    assert [t.tolist() for t in out.values] == [[2.0, 3.0]] * 2
    assert [c.tolist() for c in v.values] == [[2.0, 3.0]] * 2


def test_update_group_false_gives_tuple(mirrored2):
    with mirrored2.scope():
        v = unison.Variable(0.0)
    out = mirrored2.extended.update(v, lambda c, x: c.add_(x) * 1, args=(torch.tensor(5.0),), group=False)
    assert isinstance(out, tuple) and len(out) == 2
    assert [t.item() for t in out] == [5.0, 5.0]


def test_update_with_per_replica_args_gives_each_component_its_part(mirrored2):
    with mirrored2.scope():
        v = unison.Variable(0.0)
    mirrored2.extended.update(v, lambda c, x, scale: c.copy_(x * scale),
                              args=(PerReplica([torch.tensor(1.0), torch.tensor(2.0)]),), kwargs={"scale": 10.0})
    assert [c.item() for c in v.values] == [10.0, 20.0]


def test_update_runs_without_grad(mirrored2):
    with mirrored2.scope():
        v = unison.Variable(1.0)
    seen = []
    mirrored2.extended.update(v, lambda c: seen.append(torch.is_grad_enabled()))
    assert seen == [False, False]


def test_update_in_replica_context_runs_once_through_merge_call(mirrored2, thread_baseline):
    with mirrored2.scope():
        v = unison.Variable(0.0)
    calls = []

    def fn():
        mirrored2.extended.update(v, lambda c, x: (calls.append(1), c.add_(x)), args=(torch.tensor(1.0),))

    mirrored2.run(fn)
    assert len(calls) == 2  # once per component, not once per replica per component
    assert [c.item() for c in v.values] == [1.0, 1.0]


def test_update_of_plain_tensor(one_device):
    t = torch.zeros(2)
    out = one_device.extended.update(t, lambda c, x: c.add_(x), args=(torch.ones(2),))
    assert out is t and t.tolist() == [1.0, 1.0]


def test_variable_created_in_scope(mirrored2):
    with mirrored2.scope():
        v = unison.Variable(1.0)
    outside = unison.Variable(1.0)
    other = unison.MirroredStrategy(["cpu:0", "cpu:1"])
    assert mirrored2.extended.variable_created_in_scope(v)
    assert not mirrored2.extended.variable_created_in_scope(outside)
    assert not other.extended.variable_created_in_scope(v)
    assert not mirrored2.extended.variable_created_in_scope("not a variable")


def test_variable_created_in_scope_for_multi_element_variables(mirrored2):
    with mirrored2.scope():
        layer = nn.Linear(3, 2)
        w = unison.Variable([1.0, 2.0, 3.0])
    assert mirrored2.extended.variable_created_in_scope(w)
    assert mirrored2.extended.variable_created_in_scope(layer.weight)
    assert not mirrored2.extended.variable_created_in_scope(nn.Linear(3, 2).weight)


def test_value_container(mirrored2):
    with mirrored2.scope():
        v = unison.Variable(1.0)
    assert mirrored2.extended.value_container(v) is v
    assert mirrored2.extended.value_container(v.values[1]) is v  # a component gives its variable
    plain = torch.ones(2)
    assert mirrored2.extended.value_container(plain) is plain


def test_value_container_of_parameter_component(mirrored2):
    with mirrored2.scope():
        layer = nn.Linear(3, 2)
    weight = layer.weight
    assert mirrored2.extended.value_container(weight) is weight
    assert mirrored2.extended.value_container(weight.values[1]) is weight


def test_devices_and_roles_of_mirrored(mirrored2):
    ext = mirrored2.extended
    assert ext.worker_devices == ("cpu:0", "cpu:1")
    assert ext.parameter_devices == ("cpu:0", "cpu:1")
    assert ext.should_checkpoint is True
    assert ext.should_save_summary is True
    assert ext.experimental_should_init is True
    assert ext.experimental_between_graph is False


def test_devices_of_central_storage(central2):
    ext = central2.extended
    assert ext.worker_devices == ("cpu:0", "cpu:1")
    assert ext.parameter_devices == ("cpu:0",)
    assert ext.should_checkpoint and ext.should_save_summary and ext.experimental_should_init
    assert not ext.experimental_between_graph


def test_central_storage_default_parameter_device():
    assert unison.CentralStorageStrategy(["cpu:0", "cpu:1"]).extended.parameter_devices == ("cpu:0",)
    assert unison.CentralStorageStrategy(["cpu:1"]).extended.parameter_devices == ("cpu:1",)


def test_devices_of_one_device(one_device):
    ext = one_device.extended
    assert ext.worker_devices == ("cpu:0",) and ext.parameter_devices == ("cpu:0",)
    assert ext.should_checkpoint and ext.should_save_summary and ext.experimental_should_init
    assert not ext.experimental_between_graph


def test_repr_names_devices(mirrored2):
    assert repr(mirrored2) == "MirroredStrategy(devices=['cpu:0', 'cpu:1'])"


def test_strategies_are_final():
    for cls in (unison.MirroredStrategy, unison.CentralStorageStrategy, unison.OneDeviceStrategy):
        assert getattr(cls, "__final__", False) is True
        assert issubclass(cls, unison.Strategy)


def test_mirrored_rejects_non_cross_device_ops():
    with pytest.raises(TypeError, match=r"cross_device_ops must be a CrossDeviceOps instance, got str: 'nccl'"):
        unison.MirroredStrategy(["cpu:0", "cpu:1"], cross_device_ops="nccl")


def test_mirrored_uses_given_cross_device_ops():
    ops = unison.HierarchicalCopyAllReduce(num_packs=2)
    strategy = unison.MirroredStrategy(["cpu:0", "cpu:1"], cross_device_ops=ops)
    assert strategy.extended.cross_device_ops is ops
    out = strategy.run(lambda: get_replica_context().all_reduce("sum", torch.ones(3)))
    assert [t.tolist() for t in strategy.experimental_local_results(out)] == [[2.0, 2.0, 2.0]] * 2
