"""The rest of tf.distribute's strategy surface (issue 16, section 1), with TF's semantics."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import unison

MIRRORED = ["cpu:0", "cpu:1"]


def test_values_from_function_matches_tf_docstring_example():
    strategy = unison.MirroredStrategy(MIRRORED)

    def value_fn(ctx):
        return ctx.replica_id_in_sync_group / ctx.num_replicas_in_sync

    distributed_values = strategy.experimental_distribute_values_from_function(value_fn)
    assert strategy.experimental_local_results(distributed_values) == (0.0, 0.5)


def test_values_from_function_places_tensors_and_feeds_run():
    strategy = unison.MirroredStrategy(MIRRORED)
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.full((2,), float(ctx.replica_id_in_sync_group)))
    assert isinstance(values, unison.PerReplica)
    doubled = strategy.run(lambda v: v * 2, args=(values,))
    assert [t.tolist() for t in strategy.experimental_local_results(doubled)] == [[0.0, 0.0], [2.0, 2.0]]
    one = unison.OneDeviceStrategy("cpu:0").experimental_distribute_values_from_function(lambda ctx: 7)
    assert one == 7  # one replica: the value itself, as TF regroups it


def test_value_context_checks_its_arguments():
    assert repr(unison.ValueContext(1, 2)) == "ValueContext(replica_id_in_sync_group=1, num_replicas_in_sync=2)"
    with pytest.raises(ValueError, match=r"replica_id_in_sync_group` 2 is out of range"):
        unison.ValueContext(2, 2)
    with pytest.raises(TypeError, match="value_fn must be callable, got str: 'not callable'"):
        unison.MirroredStrategy(MIRRORED).experimental_distribute_values_from_function("not callable")


def test_cluster_resolver_is_none_for_local_strategies_and_the_resolver_otherwise():
    assert unison.OneDeviceStrategy("cpu:0").cluster_resolver is None
    assert unison.MirroredStrategy(MIRRORED).cluster_resolver is None
    assert unison.CentralStorageStrategy(MIRRORED).cluster_resolver is None
    assert unison.get_strategy().cluster_resolver is None
    resolver = unison.SimpleClusterResolver(unison.ClusterSpec({"worker": ["127.0.0.1:1", "127.0.0.1:2"]}),
                                            task_type="worker", task_id=0)
    assert unison.MultiWorkerMirroredStrategy(resolver).cluster_resolver is resolver


def test_colocate_vars_with_accepts_this_strategys_variables_and_refuses_others():
    strategy = unison.MirroredStrategy(MIRRORED)
    with strategy.scope():
        first = unison.Variable(torch.ones(2))
    with strategy.colocate_vars_with(first):
        second = unison.Variable(torch.zeros(2))
    assert second.devices == first.devices
    other = unison.MirroredStrategy(MIRRORED)
    with other.scope():
        foreign = unison.Variable(torch.ones(1))
    with pytest.raises(ValueError, match="not a variable of this strategy"):
        with strategy.extended.colocate_vars_with(foreign):
            pass


def test_replica_context_devices():
    strategy = unison.MirroredStrategy(MIRRORED)
    (devices,) = strategy.run(lambda: unison.get_replica_context().devices)  # regrouped: a tuple of PerReplica
    assert strategy.experimental_local_results(devices) == ("cpu:0", "cpu:1")
    assert unison.get_replica_context().devices == ("cpu:0",)


def test_datasets_from_function_has_tf_s_older_name():
    strategy = unison.MirroredStrategy(MIRRORED)
    data = strategy.experimental_distribute_datasets_from_function(
        lambda ctx: [torch.arange(4.0).reshape(2, 2)] * 2)
    assert isinstance(data, unison.DistributedDatasetsFromFunction)
    assert isinstance(iter(data), unison.DistributedIterator)


def test_distributed_dataset_types_are_public_and_get_next_as_optional_ends_cleanly():
    strategy = unison.MirroredStrategy(MIRRORED)
    dataset = strategy.experimental_distribute_dataset(torch.utils.data.TensorDataset(torch.arange(8.0)),
                                                       global_batch_size=4)
    assert isinstance(dataset, unison.DistributedDataset)
    iterator = iter(dataset)
    assert isinstance(iterator, unison.DistributedIterator)
    seen = []
    while (optional := iterator.get_next_as_optional()).has_value():
        seen.append(optional.get_value())
    assert len(seen) == 2
    assert strategy.extended.experimental_enable_get_next_as_optional
    assert not unison.OneDeviceStrategy("cpu:0").extended.experimental_enable_get_next_as_optional


def test_value_container_maps_every_local_result_back_to_its_variable():
    for strategy in (unison.MirroredStrategy(MIRRORED), unison.CentralStorageStrategy(MIRRORED)):
        with strategy.scope():
            layer = nn.Linear(2, 2)
            v = unison.Variable(torch.ones(3))
        for variable in (v, layer.weight):
            for component in strategy.experimental_local_results(variable):
                assert strategy.extended.value_container(component) is variable
        assert strategy.extended.value_container(torch.ones(3)) is not v


def test_experimental_set_strategy_follows_tf_rules():
    strategy = unison.MirroredStrategy(MIRRORED)
    try:
        unison.experimental_set_strategy(strategy)
        assert unison.get_strategy() is strategy and unison.in_cross_replica_context()
        other = unison.OneDeviceStrategy("cpu:0")
        unison.experimental_set_strategy(other)  # replaces the first
        assert unison.get_strategy() is other
        with other.scope():
            with pytest.raises(RuntimeError, match="must not be called inside a strategy's scope"):
                unison.experimental_set_strategy(None)
    finally:
        unison.experimental_set_strategy(None)
    assert not unison.has_strategy()
    with strategy.scope():
        with pytest.raises(RuntimeError, match="must not be called inside"):
            unison.experimental_set_strategy(strategy)
    with pytest.raises(TypeError, match="takes a unison Strategy or None, got str"):
        unison.experimental_set_strategy("mirrored")
