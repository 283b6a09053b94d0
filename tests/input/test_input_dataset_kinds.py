"""Both distributed dataset kinds are ``DistributedDataset`` instances, as in tf.distribute."""

from __future__ import annotations

import pytest
import torch

import unison
from unison import DistributedDataset, DistributedDatasetsFromFunction, InputOptions

STRATEGIES = {
    "one_device": lambda: unison.OneDeviceStrategy("cpu:0"),
    "mirrored": lambda: unison.MirroredStrategy(["cpu:0", "cpu:1"]),
    "central_storage": lambda: unison.CentralStorageStrategy(["cpu:0", "cpu:1"]),
    "default": unison.get_strategy,
}


def _dataset_fn(ctx):
    """Samples 0..7 in per-replica batches of {"x": ids}: 2 steps of the global batch of 4."""
    rows = ctx.get_per_replica_batch_size(4)
    ids = torch.arange(8)
    return [{"x": ids[i : i + rows]} for i in range(0, 8, rows)]


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_distribute_datasets_from_function_returns_a_distributed_dataset(name):
    strategy = STRATEGIES[name]()
    replicas = strategy.num_replicas_in_sync
    for distribute in (strategy.distribute_datasets_from_function,
                       strategy.experimental_distribute_datasets_from_function):
        dataset = distribute(_dataset_fn)
        assert isinstance(dataset, unison.DistributedDataset), type(dataset)
        assert isinstance(dataset, DistributedDatasetsFromFunction)
        # Iteration is unchanged: the structure of a batch is kept, each replica gets its rows.
        steps = list(dataset)
        assert len(steps) == 2
        parts = [strategy.experimental_local_results(step["x"]) for step in steps]
        assert all(set(step) == {"x"} for step in steps)
        assert all(len(p) == replicas and all(t.shape == (4 // replicas,) for t in p) for p in parts)
        assert torch.cat([t for p in parts for t in p]).tolist() == list(range(8))
    assert isinstance(strategy.experimental_distribute_dataset([torch.arange(4)]), unison.DistributedDataset)


def test_the_from_function_kind_is_a_virtual_subclass_sharing_the_common_surface():
    assert issubclass(DistributedDatasetsFromFunction, DistributedDataset)
    assert DistributedDataset not in DistributedDatasetsFromFunction.__mro__  # registered, nothing inherited
    options = InputOptions(experimental_fetch_to_device=False)
    made = DistributedDatasetsFromFunction(lambda ctx: [torch.arange(2)], devices=["cpu:0"], options=options)
    assert made.options is options
    made.set_epoch(1)
    assert [t.tolist() for t in made] == [[0, 1]]
