"""A map-style Dataset plus global_batch_size: sampled per worker, reshuffled per epoch."""

import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

from unison import AutoShardPolicy, DistributedDataset, InputOptions
from unison._input import ShardedBatchSampler


class Ids(Dataset):
    """Sample i is {'id': i, 'x': [i, -i]}."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"id": torch.tensor(i), "x": torch.tensor([float(i), -float(i)])}


def make(n, workers, replicas, **kwargs):
    devs = tuple(f"cpu:{r}" for r in range(replicas))
    return [DistributedDataset(Ids(n), devices=devs, num_workers=workers, worker_index=w, **kwargs)
            for w in range(workers)]


def ids_per_step(dataset, replicas):
    out = []
    for step in dataset:
        parts = [step["id"]] if replicas == 1 else list(step["id"].values)
        out.append([p.tolist() for p in parts])
    return out


@pytest.mark.parametrize(("workers", "replicas"), [(2, 1), (3, 1), (2, 2)])
def test_every_sample_once_per_epoch_and_equal_steps(workers, replicas):
    datasets = make(23, workers, replicas, global_batch_size=6, seed=3)
    orders = []
    for epoch in range(2):
        for d in datasets:
            d.set_epoch(epoch)
        per_worker = [ids_per_step(d, replicas) for d in datasets]
        assert [len(s) for s in per_worker] == [4] * workers  # ceil(23 / 6), the same everywhere
        seen = [i for steps in per_worker for step in steps for part in step for i in part]
        assert sorted(seen) == list(range(23))
        # Step k across workers and replicas is the k-th global batch of the epoch's order.
        orders.append([i for k in range(4) for w in range(workers) for part in per_worker[w][k] for i in part])
    assert orders[0] != orders[1]  # a new epoch reshuffles
    for d in datasets:
        d.set_epoch(0)
    assert [i for step in ids_per_step(datasets[0], replicas) for part in step for i in part] == [
        i for step in ids_per_step(make(23, workers, replicas, global_batch_size=6, seed=3)[0], replicas)
        for part in step for i in part
    ]


def test_unshuffled_order_and_uneven_last_batch_on_two_workers_two_replicas():
    datasets = make(10, 2, 2, global_batch_size=4, shuffle=False)
    assert ids_per_step(datasets[0], 2) == [[[0], [1]], [[4], [5]], [[8], []]]
    assert ids_per_step(datasets[1], 2) == [[[2], [3]], [[6], [7]], [[9], []]]


def test_a_worker_with_an_empty_share_gets_an_empty_batch_of_the_same_structure():
    w0, w1 = make(5, 2, 1, global_batch_size=4, shuffle=False)
    last = list(w1)[-1]
    assert last["id"].shape == (0,) and last["x"].shape == (0, 2) and last["x"].dtype == torch.float32
    assert [s["id"].tolist() for s in w0] == [[0, 1], [4]]
    # Even when the very first share is empty (fewer samples than workers).
    (only,) = list(make(1, 2, 1, global_batch_size=2)[1])
    assert only["x"].shape == (0, 2)


def test_drop_last_drops_the_smaller_global_batch():
    datasets = make(10, 2, 1, global_batch_size=4, drop_last=True, shuffle=False)
    assert [len(d) for d in datasets] == [2, 2]
    assert sorted(i for d in datasets for s in d for i in s["id"].tolist()) == list(range(8))


def test_off_gives_every_worker_every_sample_in_per_worker_batches():
    datasets = make(10, 2, 1, global_batch_size=4, shuffle=False, options=InputOptions(auto_shard_policy="OFF"))
    assert all(d.shard_policy is AutoShardPolicy.OFF for d in datasets)
    for d in datasets:
        assert ids_per_step(d, 1) == [[[0, 1]], [[2, 3]], [[4, 5]], [[6, 7]], [[8, 9]]]


def test_loader_kwargs_reach_the_dataloader_with_worker_processes():
    data = TensorDataset(torch.arange(9))
    collate_calls = []

    def collate(samples):
        collate_calls.append(len(samples))
        return torch.stack([s[0] for s in samples])

    d = DistributedDataset(data, devices=["cpu:0"], num_workers=3, worker_index=2, global_batch_size=6, shuffle=False,
                           loader_kwargs={"collate_fn": collate})
    assert [s.tolist() for s in d] == [[4, 5], [8]]
    assert collate_calls == [2, 1]
    forked = DistributedDataset(Ids(8), devices=["cpu:0"], num_workers=2, worker_index=1, global_batch_size=4,
                                loader_kwargs={"num_workers": 1})
    assert len([s for s in forked]) == 2


def test_map_style_errors():
    with pytest.raises(TypeError,
                       match=r"a map-style Dataset \(Ids\) yields samples, not batches: pass `global_batch_size=`"):
        DistributedDataset(Ids(4), devices=["cpu:0"])
    with pytest.raises(ValueError, match=r"`global_batch_size` 5 is not divisible by the number of workers 2"):
        DistributedDataset(Ids(10), devices=["cpu:0"], num_workers=2, global_batch_size=5)
    with pytest.raises(ValueError, match=r"`global_batch_size` is 2, smaller than the 4 replicas in sync "
                                         r"\(2 worker\(s\) x 2 local replica\(s\)\)"):
        DistributedDataset(Ids(10), devices=["cpu:0", "cpu:1"], num_workers=2, global_batch_size=2)
    with pytest.raises(ValueError, match=r"`loader_kwargs` sets \['batch_size', 'shuffle'\], "
                                         r"which the distributed dataset decides"):
        DistributedDataset(Ids(10), devices=["cpu:0"], global_batch_size=2,
                           loader_kwargs={"batch_size": 2, "shuffle": True})
    with pytest.raises(ValueError, match=r"auto_shard_policy=FILE needs a dataset exposing `files`"
                                         r".*map-style Dataset is sharded by sample"):
        DistributedDataset(Ids(10), devices=["cpu:0"], global_batch_size=2,
                           options=InputOptions(auto_shard_policy="file"))


def test_sampler_alone_is_a_batch_sampler():
    sampler = ShardedBatchSampler(7, 4, num_workers=2, worker_index=1, shuffle=False)
    assert list(sampler) == [[2, 3], [6]] and len(sampler) == 2
    sampler.set_epoch(1)
    assert sampler.epoch == 1
