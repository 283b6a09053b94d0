"""Distributed variables: creation, module parameters, replica reads, writes and aggregation."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import unison
from tests.strategies._training import assert_trains_as_on_one_device
from unison import (
    MirroredVariable,
    PerReplica,
    SyncOnReadVariable,
    VariableAggregation,
    VariableSynchronization,
    get_replica_context,
)

pytestmark = pytest.mark.timeout(30)


def _rid() -> int:
    return get_replica_context().replica_id_in_sync_group


def _components(v) -> list:
    return [c.tolist() for c in v.values]


# --- creation ----------------------------------------------------------------------------


def test_variable_outside_strategy_is_plain():
    v = unison.Variable(1.5)
    assert type(v) is torch.Tensor
    assert v.item() == 1.5 and v.requires_grad
    assert not unison.Variable(1.5, trainable=False).requires_grad
    i = unison.Variable([1, 2])
    assert type(i) is torch.Tensor and i.dtype == torch.int64 and not i.requires_grad
    source = torch.ones(2)
    copied = unison.Variable(source)
    source.add_(1)
    assert copied.tolist() == [1.0, 1.0]  # the initial value is copied


def test_variable_in_mirrored_scope_is_mirrored(mirrored2):
    with mirrored2.scope():
        v = unison.Variable([1.0, 2.0], name="w")
    assert isinstance(v, MirroredVariable) and isinstance(v, unison.DistributedValues)
    assert v.devices == ("cpu:0", "cpu:1")
    assert v.name == "w" and v.aggregation is VariableAggregation.NONE
    assert _components(v) == [[1.0, 2.0], [1.0, 2.0]]
    assert v.values[0].data_ptr() != v.values[1].data_ptr()  # one copy per device
    assert v.requires_grad


def test_variable_in_central_storage_scope_has_one_storage(central2):
    with central2.scope():
        v = unison.Variable(3.0)
    assert isinstance(v, MirroredVariable)
    assert len(v.values) == 1 and v.devices == ("cpu:0",)
    out = central2.run(lambda: v * 1)
    assert [t.item() for t in central2.experimental_local_results(out)] == [3.0, 3.0]


def test_variable_in_one_device_scope_is_plain(one_device):
    with one_device.scope():
        v = unison.Variable(3.0)
    assert type(v) is torch.Tensor and v.requires_grad
    assert one_device.extended.variable_created_in_scope(v)


def test_sync_on_read_variable(mirrored2):
    with mirrored2.scope():
        v = unison.Variable(0.0, synchronization="on_read", aggregation="sum")
    assert isinstance(v, SyncOnReadVariable)
    assert not v.requires_grad  # ON_READ defaults to non-trainable


@pytest.mark.parametrize("sync", ["ON_READ", VariableSynchronization.ON_READ, "on_read"])
def test_trainable_on_read_raises(mirrored2, sync):
    with pytest.raises(ValueError, match=r"variable 'acc': synchronization=ON_READ is only for non-trainable"):
        with mirrored2.scope():
            unison.Variable(0.0, trainable=True, synchronization=sync, aggregation="sum", name="acc")


def test_on_read_without_aggregation_raises(mirrored2):
    with pytest.raises(ValueError, match=r"SyncOnReadVariable needs an aggregation .* got VariableAggregation.NONE"):
        with mirrored2.scope():
            unison.Variable(0.0, synchronization="on_read")


def test_unknown_enum_names_raise():
    with pytest.raises(ValueError, match=r"aggregation 'max' is not a VariableAggregation: use one of NONE, SUM, MEAN"):
        unison.Variable(0.0, aggregation="max")
    with pytest.raises(ValueError, match=r"synchronization 'sometimes' is not a VariableSynchronization"):
        unison.Variable(0.0, synchronization="sometimes")


def test_variable_created_inside_run_raises(mirrored2):
    with pytest.raises(ValueError, match=r"variable 'v' created inside strategy.run: create variables in "
                                         r"cross-replica context"):
        mirrored2.run(lambda: unison.Variable(1.0, name="v"))


# --- module parameters -------------------------------------------------------------------


def test_module_parameters_become_mirrored_with_equal_components(mirrored2):
    torch.manual_seed(0)
    with mirrored2.scope():
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Conv1d(1, 2, 3), nn.LayerNorm(2))
    params = list(model.parameters())
    assert len(params) == 6
    for p in params:
        assert isinstance(p, MirroredVariable) and isinstance(p, nn.Parameter)
        first, second = p.values
        assert torch.equal(first, second)  # initialised on one device, copied to the other
        assert first.abs().sum() > 0 or p.dim() == 1
        assert mirrored2.extended.value_container(second) is p
    assert [name for name, _ in model.named_parameters()] == [
        "0.weight", "0.bias", "2.weight", "2.bias", "3.weight", "3.bias"]


def test_module_parameters_match_a_plain_module_with_the_same_seed(mirrored2):
    torch.manual_seed(3)
    plain = nn.Linear(5, 3)
    torch.manual_seed(3)
    with mirrored2.scope():
        mirrored = nn.Linear(5, 3)
    for p, q in zip(plain.parameters(), mirrored.parameters()):
        for component in q.values:
            assert torch.equal(component, p.detach())


def test_module_outside_scope_stays_plain(mirrored2):
    with mirrored2.scope():
        pass
    layer = nn.Linear(2, 2)
    assert type(layer.weight) is nn.Parameter


def test_module_parameters_under_one_device_stay_plain(one_device):
    with one_device.scope():
        layer = nn.Linear(2, 2)
    assert type(layer.weight) is nn.Parameter


def test_module_state_dict_is_plain(mirrored2):
    with mirrored2.scope():
        layer = nn.Linear(3, 2)
    state = layer.state_dict()
    assert all(type(t) is torch.Tensor for t in state.values())
    assert torch.equal(state["weight"], layer.weight.values[0])


def test_variable_pickles_as_plain_parameter(mirrored2):
    with mirrored2.scope():
        layer = nn.Linear(3, 2)
    buffer = io.BytesIO()
    torch.save(layer.weight, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert type(loaded) is nn.Parameter and torch.equal(loaded, layer.weight.values[0])


def test_a_deep_copy_is_a_new_variable_of_the_same_strategy(mirrored2):
    """As TensorFlow's ``DistributedVariable.__deepcopy__``: a variable of the same strategy with
    storage of its own, so that an EMA or teacher copy, or a layer ``nn.TransformerEncoder``
    clones, trains apart from the original."""
    with mirrored2.scope():
        layer = nn.Linear(3, 2)
    before = [c.clone() for c in layer.weight.values]
    copied = copy.deepcopy(layer.weight)  # outside the scope, as an EMA copy is taken
    assert type(copied) is MirroredVariable and copied is not layer.weight
    assert copied._strategy is mirrored2 and copied.devices == layer.weight.devices
    for mine, theirs in zip(copied.values, layer.weight.values, strict=True):
        assert torch.equal(mine, theirs) and mine.data_ptr() != theirs.data_ptr()
    with torch.no_grad():
        copied.add_(1.0)  # a write to the copy: every component of it, none of the original's
    seen = mirrored2.experimental_local_results(mirrored2.run(lambda: copied * 1))  # replicas read the copy
    assert len(seen) == 2 and all(torch.equal(t, before[0] + 1) for t in seen)
    assert all(torch.equal(c, b + 1) for c, b in zip(copied.values, before, strict=True))
    assert all(torch.equal(c, b) for c, b in zip(layer.weight.values, before, strict=True))


# --- reads ----------------------------------------------------------------------------------


def test_replica_reads_see_local_component(mirrored2):
    with mirrored2.scope():
        v = unison.Variable(0.0)
    mirrored2.extended.update(v, lambda c, x: c.copy_(x), args=(PerReplica([torch.tensor(1.0), torch.tensor(2.0)]),))

    def fn():
        return v * 10, v.read_value(), v + torch.zeros(1), torch.add(v, 0.5)

    out = mirrored2.run(fn)
    assert [[t.item() for t in mirrored2.experimental_local_results(o)] for o in out] == [
        [10.0, 20.0], [1.0, 2.0], [1.0, 2.0], [1.5, 2.5]]
    # cross-replica reads see component 0
    assert (v * 1).item() == 1.0 and v.read_value().item() == 1.0


def test_module_forward_uses_local_component(mirrored2):
    with mirrored2.scope():
        layer = nn.Linear(2, 1, bias=False)
    mirrored2.extended.update(layer.weight, lambda c, x: c.copy_(x),
                              args=(PerReplica([torch.ones(1, 2), 2 * torch.ones(1, 2)]),))
    out = mirrored2.run(lambda x: layer(x), args=(torch.ones(1, 2),))
    assert [t.item() for t in mirrored2.experimental_local_results(out)] == [2.0, 4.0]


def test_gradients_land_on_local_component(mirrored2):
    with mirrored2.scope():
        layer = nn.Linear(2, 1, bias=False)

    def fn(x):
        with mirrored2.extended.no_sync():  # no reduction: each replica keeps its own gradient
            layer(x).sum().backward()
        return layer.weight.grad.clone()

    x = PerReplica([torch.ones(1, 2), 3 * torch.ones(1, 2)])
    grads = mirrored2.experimental_local_results(mirrored2.run(fn, args=(x,)))
    assert [g.tolist() for g in grads] == [[[1.0, 1.0]], [[3.0, 3.0]]]
    assert layer.weight.grad.tolist() == [[1.0, 1.0]]  # cross-replica: component 0's gradient


# --- cross-replica writes ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("write", "expected"),
    [
        (lambda v: v.copy_(torch.tensor([5.0, 6.0])), [5.0, 6.0]),
        (lambda v: v.add_(1.0), [2.0, 3.0]),
        (lambda v: v.sub_(torch.tensor([1.0, 1.0]), alpha=2), [-1.0, 0.0]),
        (lambda v: v.mul_(3.0), [3.0, 6.0]),
        (lambda v: v.fill_(7.0), [7.0, 7.0]),
        (lambda v: v.zero_(), [0.0, 0.0]),
        (lambda v: v.__setitem__(0, 9.0), [9.0, 2.0]),
        (lambda v: v.assign([4.0, 4.0]), [4.0, 4.0]),
        (lambda v: v.assign_add(torch.tensor([1.0, 1.0])), [2.0, 3.0]),
        (lambda v: v.assign_sub(1.0), [0.0, 1.0]),
        (lambda v: nn.init.constant_(v, 0.5), [0.5, 0.5]),
        (lambda v: torch.add(torch.ones(2), torch.ones(2), out=v), [2.0, 2.0]),
    ],
    ids=["copy_", "add_", "sub_alpha", "mul_", "fill_", "zero_", "setitem", "assign", "assign_add", "assign_sub",
         "nn.init", "out="],
)
def test_cross_replica_write_reaches_every_component(mirrored2, write, expected):
    with mirrored2.scope():
        v = unison.Variable([1.0, 2.0])
    with torch.no_grad():
        write(v)
    assert _components(v) == [expected, expected]


@pytest.mark.parametrize(
    "init",
    ["uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "xavier_uniform_",
     "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_"],
)
def test_nn_init_after_scope_reaches_every_component(mirrored2, init):
    # nn.init's uniform_/normal_/constant_/kaiming_uniform_ dispatch with the tensor as a keyword argument
    with mirrored2.scope():
        layer = nn.Linear(4, 4)
    before = layer.weight.values[1].clone()
    args = (0.5,) if init in ("constant_", "sparse_") else ()
    torch.manual_seed(1)
    getattr(nn.init, init)(layer.weight, *args)
    first, second = layer.weight.values
    assert torch.equal(first, second)
    assert not torch.equal(second, before)
    plain = torch.empty(4, 4)
    torch.manual_seed(1)
    getattr(nn.init, init)(plain, *args)
    assert torch.equal(first, plain)  # the same draw as on a plain tensor


def test_cross_replica_load_state_dict_reaches_every_component(mirrored2):
    with mirrored2.scope():
        layer = nn.Linear(2, 1)
    layer.load_state_dict({"weight": torch.tensor([[1.0, 2.0]]), "bias": torch.tensor([3.0])})
    assert _components(layer.weight) == [[[1.0, 2.0]]] * 2
    assert _components(layer.bias) == [[3.0]] * 2


@pytest.mark.parametrize("strategy", ["mirrored", "central_storage"])
def test_converting_a_module_after_scope_reaches_every_component(strategy):
    """``module.double()`` after ``scope()`` replaces each parameter's data: every replica
    trains in the new dtype, as the same module converted on one device does."""
    devices = ["cpu:0", "cpu:1"]
    made = unison.MirroredStrategy(devices) if strategy == "mirrored" else unison.CentralStorageStrategy(devices)

    def make():
        torch.manual_seed(0)
        return nn.Linear(3, 2)

    model = assert_trains_as_on_one_device(made, make, torch.randn(4, 3, dtype=torch.float64),
                                           convert=lambda m: m.double(), atol=1e-12)
    assert all(c.dtype == torch.float64 for p in model.parameters() for c in p.values)


@pytest.mark.parametrize("parametrization", ["weight_norm", "orthogonal"])
def test_parametrized_modules_in_scope_train_as_on_one_device(mirrored2, parametrization):
    """``torch.nn.utils.parametrize`` takes a module's weight over: with ``nn.Parameter(weight)``
    (weight_norm), which in scope is the variable itself, or with ``weight.set_(...)``
    (orthogonal), which bypasses dispatch and is adopted when the weight is registered again.
    Either trains as on one device."""
    from torch.nn.utils import parametrizations

    def make():
        torch.manual_seed(0)
        return nn.Sequential(getattr(parametrizations, parametrization)(nn.Linear(3, 3)), nn.Tanh(), nn.Linear(3, 2))

    model = assert_trains_as_on_one_device(mirrored2, make,
                                           torch.randn(4, 3, generator=torch.Generator().manual_seed(2)))
    weights = [p for name, p in model[0].named_parameters() if "original" in name]
    assert weights and all(isinstance(w, unison.MirroredVariable) and nn.Parameter(w) is w for w in weights)


def test_freezing_a_parameter_after_scope_freezes_every_replica(mirrored2):
    with mirrored2.scope():
        layer = nn.Linear(3, 2)
        opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    layer.weight.requires_grad_(False)
    frozen, bias = layer.weight.values[0].clone(), layer.bias.values[0].clone()

    def step(batch):
        opt.zero_grad()
        layer(batch).pow(2).sum().backward()
        opt.step()

    mirrored2.run(step, args=(unison.PerReplica([torch.ones(2, 3), torch.ones(2, 3) * 2]),))
    assert all(not c.requires_grad for c in layer.weight.values)
    assert all(torch.equal(c, frozen) for c in layer.weight.values)  # no replica stepped it
    assert all(not torch.equal(c, bias) for c in layer.bias.values)
    assert torch.equal(*layer.bias.values)


# --- replica-context writes -------------------------------------------------------------------


def test_replica_write_with_aggregation_none_raises(mirrored2, thread_baseline):
    with mirrored2.scope():
        v = unison.Variable(0.0, name="step")

    def fn():
        v.assign_add(1.0)

    with pytest.raises(ValueError, match=r"in-place `add_` on MirroredVariable 'step' inside a replica: with "
                                         r"aggregation=VariableAggregation.NONE replicas cannot write it"):
        mirrored2.run(fn)
    assert _components(v) == [0.0, 0.0]


def test_replica_write_of_unaggregatable_op_raises(mirrored2, thread_baseline):
    with mirrored2.scope():
        v = unison.Variable(1.0, aggregation="sum")

    def fn():
        with torch.no_grad():
            v.mul_(2.0)

    with pytest.raises(ValueError, match=r"in-place `mul_` on a MirroredVariable inside a replica cannot be "
                                         r"aggregated"):
        mirrored2.run(fn)


@pytest.mark.parametrize(
    ("aggregation", "assign_add", "assign"),
    [
        # replica i adds (i + 1): SUM adds 1 + 2, MEAN adds 1.5, ONLY_FIRST_REPLICA adds replica 0's 1
        ("sum", 3.0, 30.0),
        (VariableAggregation.MEAN, 1.5, 15.0),
        ("ONLY_FIRST_REPLICA", 1.0, 10.0),
    ],
)
def test_replica_writes_are_aggregated(mirrored2, aggregation, assign_add, assign, thread_baseline):
    with mirrored2.scope():
        v = unison.Variable(0.0, aggregation=aggregation)
    mirrored2.run(lambda: v.assign_add(float(_rid() + 1)))
    assert _components(v) == [assign_add, assign_add]
    mirrored2.run(lambda: v.assign_sub(float(_rid() + 1)))
    assert _components(v) == [0.0, 0.0]
    mirrored2.run(lambda: v.assign(10.0 * (_rid() + 1)))  # SUM of assigns, as in TF
    assert _components(v) == [assign, assign]


def test_replica_write_reads_back_in_the_replica(mirrored2):
    with mirrored2.scope():
        v = unison.Variable(0.0, aggregation="mean")

    def fn():
        v.assign_add(float(_rid()))
        return v * 1

    out = mirrored2.run(fn)
    assert [t.item() for t in mirrored2.experimental_local_results(out)] == [0.5, 0.5]


# --- sync on read ------------------------------------------------------------------------------


@pytest.mark.parametrize(("aggregation", "expected"), [("sum", 3.0), ("mean", 1.5), ("only_first_replica", 1.0)])
def test_sync_on_read_aggregates_on_cross_replica_read(mirrored2, aggregation, expected, thread_baseline):
    with mirrored2.scope():
        v = unison.Variable(0.0, synchronization="on_read", aggregation=aggregation)

    def fn():
        v.assign_add(float(_rid() + 1))  # each replica writes its own component
        return v * 1  # and reads it back

    local = mirrored2.experimental_local_results(mirrored2.run(fn))
    assert [t.item() for t in local] == [1.0, 2.0]
    assert _components(v) == [1.0, 2.0]
    assert (v * 1).item() == expected
    assert v.read_value().item() == expected
    assert torch.add(v, 0).item() == expected


def test_sync_on_read_cross_replica_assign_reads_back(mirrored2):
    with mirrored2.scope():
        total = unison.Variable(0.0, synchronization="on_read", aggregation="sum")
        mean = unison.Variable(0.0, synchronization="on_read", aggregation="mean")
    total.assign(6.0)
    mean.assign(6.0)
    assert _components(total) == [3.0, 3.0] and (total * 1).item() == 6.0
    assert _components(mean) == [6.0, 6.0] and (mean * 1).item() == 6.0
    total.zero_()
    assert _components(total) == [0.0, 0.0]


def test_sync_on_read_metric_over_steps(mirrored2):
    with mirrored2.scope():
        count = unison.Variable(0, synchronization="on_read", aggregation="sum")

    def fn(batch):
        count.add_(batch.numel())

    for _ in range(3):
        mirrored2.run(fn, args=(PerReplica([torch.ones(2), torch.ones(5)]),))
    assert count.dtype == torch.int64
    assert _components(count) == [6, 15]
    assert (count + 0).item() == 21
