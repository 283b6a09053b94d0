"""Bad input gives clear errors: non-tensors, changing structures, too-small batches, bad arguments."""

import warnings

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from unison import DistributedDataset, InputOptions


def run(data, **kwargs):
    kwargs.setdefault("devices", ["cpu:0"])
    return list(DistributedDataset(data, **kwargs))


@pytest.mark.parametrize(
    ("batch", "match"),
    [
        ({"x": torch.ones(2), "label": [1, 2]},
         r"global batch at step 0: `batch\['label'\]\[0\]` is a int \(1\), not a torch.Tensor.*torch.as_tensor"),
        (("a", "b"), r"global batch at step 0: `batch\[0\]` is a str \('a'\), not a torch.Tensor"),
        ([1.5, 2.5], r"`batch\[0\]` is a float \(1.5\)"),
        ("text", r"`batch` is a str \('text'\)"),
    ],
)
def test_non_tensor_leaves_name_their_path_and_type(batch, match):
    with pytest.raises(TypeError, match=match):
        run([batch])


def test_a_batch_with_a_different_structure_names_the_step_and_both_structures():
    data = [{"x": torch.ones(2), "y": torch.ones(2)}, {"x": torch.ones(2), "y": torch.ones(2)}, {"x": torch.ones(2)}]
    with pytest.raises(ValueError, match=r"global batch at step 2 has structure \{'x': Tensor\}, "
                                         r"but the first global batch had \{'x': Tensor, 'y': Tensor\}"):
        run(data)


def test_leaves_with_different_batch_sizes():
    with pytest.raises(ValueError, match=r"leaves have different batch sizes \(`batch\['x'\]`: 4, `batch\['y'\]`: 3\)"):
        run([{"x": torch.ones(4), "y": torch.ones(3)}])


def test_a_leaf_without_batch_dimension():
    with pytest.raises(ValueError, match=r"`batch\[1\]` is a 0-d tensor with no batch dimension"):
        run([(torch.ones(2), torch.tensor(3.0))])


def test_a_batch_without_tensors():
    with pytest.raises(ValueError, match=r"global batch at step 0 holds no tensors \(\{\}\)"):
        run([{}])


def test_a_global_batch_smaller_than_the_replicas_in_sync():
    with pytest.raises(ValueError, match=r"the first global batch size is 3, smaller than the 4 replicas in sync "
                                         r"\(2 worker\(s\) x 2 local replica\(s\)\).*at least 4"):
        run([torch.ones(3), torch.ones(3)], devices=["cpu:0", "cpu:1"], num_workers=2)
    loader = DataLoader(TensorDataset(torch.ones(10)), batch_size=3)
    with pytest.raises(ValueError, match=r"the DataLoader's `batch_size` is 3, smaller than the 4 replicas in sync"):
        DistributedDataset(loader, devices=["cpu:0", "cpu:1"], num_workers=2)


def test_a_smaller_later_batch_is_split_as_evenly_as_possible():
    steps = run([torch.arange(4), torch.arange(4, 5)], devices=["cpu:0", "cpu:1"], num_workers=2, worker_index=1)
    assert [[t.tolist() for t in s.values] for s in steps] == [[[2], [3]], [[], []]]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"global_batch_size": 4}, ValueError,
         r"`global_batch_size` is only for map-style Datasets; list must already yield batches"),
        ({"drop_last": True, "seed": 1}, ValueError,
         r"\['drop_last', 'seed'\] only apply to map-style Datasets.*on the DataLoader"),
        ({"worker_index": 2, "num_workers": 2}, ValueError,
         r"`worker_index` 2 is out of range: there are 2 workers \(valid 0\.\.1\)"),
        ({"devices": ["cpu:0", "CPU:0"]}, ValueError, r"`devices` lists device 'CPU:0' twice"),
        ({"options": {"pin_memory": True}}, TypeError, r"`options` must be an InputOptions or None, got dict"),
        ({"agree": True}, TypeError, r"`agree` must be a callable agree\(local_has_data\) -> bool or None, got True"),
        ({"options": InputOptions(experimental_replication_mode="PER_REPLICA")}, ValueError,
         r"PER_REPLICA\) is only supported by distribute_datasets_from_function"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    kwargs.setdefault("devices", ["cpu:0"])
    with pytest.raises(error, match=match):
        DistributedDataset([torch.ones(4)], **kwargs)


@pytest.mark.parametrize("dataset", [torch.ones(4), {"x": torch.ones(4)}, 3, "abc"])
def test_not_an_iterable_of_batches(dataset):
    with pytest.raises(TypeError, match=r"experimental_distribute_dataset needs an iterable of global batches"):
        DistributedDataset(dataset, devices=["cpu:0"])


def test_a_loader_already_sharded_by_distributed_sampler_is_rejected():
    data = TensorDataset(torch.arange(8))
    loader = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, num_replicas=2, rank=0))
    with pytest.raises(ValueError, match=r"already shards with a DistributedSampler.*`global_batch_size=`"):
        DistributedDataset(loader, devices=["cpu:0"], num_workers=2)


def test_an_unseeded_shuffling_loader_warns_under_data_sharding():
    data = TensorDataset(torch.arange(8))
    with pytest.warns(UserWarning, match=r"unseeded RandomSampler: "
                                         r"under DATA sharding every worker must read the same order") as record:
        DistributedDataset(DataLoader(data, batch_size=4, shuffle=True), devices=["cpu:0"], num_workers=2)
    assert record[0].filename == __file__
    seeded = DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DistributedDataset(seeded, devices=["cpu:0"], num_workers=2)
        DistributedDataset(DataLoader(data, batch_size=4, shuffle=True), devices=["cpu:0"])  # one worker
