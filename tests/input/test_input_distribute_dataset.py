"""experimental_distribute_dataset over iterables of global batches: DATA, FILE, OFF, AUTO."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from unison import AutoShardPolicy, DistributedDataset, InputOptions
from unison._values.values import PerReplica


def global_batches(sizes):
    """Global batches whose rows are their sample ids 0..sum(sizes)-1."""
    out, start = [], 0
    for size in sizes:
        out.append(torch.arange(start, start + size))
        start += size
    return out


def devices(n):
    return tuple(f"cpu:{i}" for i in range(n))


def distributed(data, workers, replicas, **kwargs):
    return lambda w: DistributedDataset(data, devices=devices(replicas), num_workers=workers, worker_index=w, **kwargs)


@pytest.mark.parametrize("workers", [2, 3])
def test_data_sharding_uses_every_sample_once_and_each_step_is_one_global_batch(helpers, workers):
    batches = global_batches([12] * 7 + [5])  # 89 samples, uneven last batch
    per_worker = helpers.run_workers(distributed(batches, workers, 1), workers, 1)
    assert [len(steps) for steps in per_worker] == [len(batches)] * workers
    for step, batch in enumerate(batches):
        joined = torch.cat([per_worker[w][step][0] for w in range(workers)])
        assert torch.equal(joined, batch)
    every = torch.cat([t for steps in per_worker for step in steps for t in step])
    assert sorted(every.tolist()) == list(range(89))


def test_uneven_last_batch_on_two_workers_with_two_replicas(helpers):
    batches = global_batches([8, 8, 2])  # the last global batch has fewer rows than replicas
    per_worker = helpers.run_workers(distributed(batches, 2, 2), 2, 2)
    sizes = [[[len(t) for t in step] for step in steps] for steps in per_worker]
    assert sizes == [[[2, 2], [2, 2], [1, 0]], [[2, 2], [2, 2], [1, 0]]]
    assert per_worker[0][2][0].tolist() == [16] and per_worker[1][2][0].tolist() == [17]
    assert per_worker[1][2][1].shape == (0,) and per_worker[1][2][1].dtype == torch.int64
    every = torch.cat([t for steps in per_worker for step in steps for t in step])
    assert sorted(every.tolist()) == list(range(18))


def test_one_local_replica_yields_the_plain_structure():
    batch = {"x": torch.arange(8.0).reshape(4, 2), "y": (torch.arange(4), torch.ones(4, 3))}
    (step,) = list(DistributedDataset([batch], devices=["cpu:0"]))
    assert isinstance(step, dict) and isinstance(step["y"], tuple)
    assert torch.equal(step["x"], batch["x"]) and torch.equal(step["y"][1], batch["y"][1])


def test_several_replicas_yield_per_replica_leaves_in_the_same_structure():
    batch = {"x": torch.arange(12.0).reshape(6, 2), "y": torch.arange(6)}
    (step,) = list(DistributedDataset([batch], devices=["cpu:0", "cpu:1", "cpu:2"]))
    assert set(step) == {"x", "y"}
    assert isinstance(step["x"], PerReplica) and isinstance(step["y"], PerReplica)
    assert [t.tolist() for t in step["y"].values] == [[0, 1], [2, 3], [4, 5]]
    assert torch.equal(torch.cat(step["x"].values), batch["x"])


@settings(max_examples=40)
@given(
    workers=st.integers(1, 4),
    replicas=st.integers(1, 3),
    data=st.data(),
)
def test_data_sharding_property(helpers, workers, replicas, data):
    first = data.draw(st.integers(workers * replicas, 20), label="first")
    rest = data.draw(st.lists(st.integers(0, 20), max_size=5), label="rest")
    batches = global_batches([first, *rest])
    per_worker = helpers.run_workers(distributed(batches, workers, replicas), workers, replicas)
    assert all(len(steps) == len(batches) for steps in per_worker)
    for step, batch in enumerate(batches):
        joined = torch.cat([t for w in range(workers) for t in per_worker[w][step]])
        assert torch.equal(joined, batch)
        sizes = [len(t) for w in range(workers) for t in per_worker[w][step]]
        assert max(sizes) - min(sizes) <= 1


class FileBatches:
    """A file-backed dataset: each 'file' holds a range of sample ids, read in batches."""

    def __init__(self, files, batch_size):
        self.files = list(files)
        self.batch_size = batch_size

    def with_files(self, files):
        ids = torch.cat([torch.arange(start, stop) for start, stop in files])
        return [ids[i : i + self.batch_size] for i in range(0, len(ids), self.batch_size)]

    def __iter__(self):
        return iter(self.with_files(self.files))


def test_auto_picks_file_when_the_dataset_exposes_enough_files(helpers):
    files = [(i * 8, i * 8 + 8) for i in range(4)]  # 4 files of 8 samples
    data = FileBatches(files, batch_size=4)
    made = [DistributedDataset(data, devices=["cpu:0"], num_workers=2, worker_index=w) for w in range(2)]
    assert [d.shard_policy for d in made] == [AutoShardPolicy.FILE] * 2
    per_worker = [[s.tolist() for s in d] for d in made]
    # Worker 0 reads files 0 and 2, worker 1 files 1 and 3; each batch of 4 becomes 2 steps of 2.
    assert per_worker[0][:2] == [[0, 1], [2, 3]]
    assert per_worker[1][:2] == [[8, 9], [10, 11]]
    assert [len(s) for s in per_worker] == [8, 8]
    assert sorted(i for steps in per_worker for s in steps for i in s) == list(range(32))


def test_auto_falls_back_to_data_with_fewer_files_than_workers_or_one_worker():
    data = FileBatches([(0, 8)], batch_size=4)
    assert (DistributedDataset(data, devices=["cpu:0"], num_workers=2, worker_index=0).shard_policy
            is AutoShardPolicy.DATA)
    two = FileBatches([(0, 4), (4, 8)], batch_size=4)
    assert DistributedDataset(two, devices=["cpu:0"]).shard_policy is AutoShardPolicy.DATA
    assert (DistributedDataset(global_batches([4]), devices=["cpu:0"], num_workers=2).shard_policy
            is AutoShardPolicy.DATA)


def test_explicit_file_policy_errors():
    off = InputOptions(auto_shard_policy=AutoShardPolicy.FILE)
    with pytest.raises(ValueError, match=r"FILE sharding needs at least one file per worker, "
                                         r"got 1 files for 2 workers: use AutoShardPolicy.DATA"):
        DistributedDataset(FileBatches([(0, 8)], 4), devices=["cpu:0"], num_workers=2, options=off)
    with pytest.raises(ValueError, match=r"auto_shard_policy=FILE but list does not expose files.*use DATA"):
        DistributedDataset(global_batches([4]), devices=["cpu:0"], num_workers=2, options=off)


def test_off_gives_every_worker_all_data_at_the_per_replica_batch_size(helpers):
    batches = global_batches([8, 8, 3])
    options = InputOptions(auto_shard_policy="off")
    per_worker = helpers.run_workers(distributed(batches, 2, 2, options=options), 2, 2)
    for steps in per_worker:  # each worker alone covers all 19 samples once
        assert len(steps) == 6  # every global batch becomes num_workers steps
        assert sorted(torch.cat([t for step in steps for t in step]).tolist()) == list(range(19))
        assert [len(t) for t in steps[0]] == [2, 2]  # 8 / (2 workers x 2 replicas)
    assert len(distributed(batches, 2, 2, options=options)(0)) == 6


def test_len_is_the_number_of_steps_when_known():
    assert len(DistributedDataset(global_batches([4, 4, 1]), devices=["cpu:0"], num_workers=2)) == 3
    unknown = DistributedDataset((b for b in global_batches([4])), devices=["cpu:0"])
    with pytest.raises(TypeError, match=r"the number of steps of this distributed dataset is unknown "
                                        r"\(policy DATA, dataset generator\)"):
        len(unknown)


def test_a_dataloader_of_global_batches_is_sharded():
    samples = torch.utils.data.TensorDataset(torch.arange(10), torch.arange(10) * 10)
    loader = torch.utils.data.DataLoader(samples, batch_size=4)
    made = [DistributedDataset(loader, devices=["cpu:0"], num_workers=2, worker_index=w) for w in range(2)]
    steps = [list(d) for d in made]
    assert [[x.tolist() for x, _ in s] for s in steps] == [[[0, 1], [4, 5], [8]], [[2, 3], [6, 7], [9]]]
    assert torch.equal(steps[1][0][1], torch.tensor([20, 30]))


def test_set_epoch_is_forwarded_to_a_loader_sampler_and_ignored_otherwise():
    class EpochSampler(torch.utils.data.SequentialSampler):
        epoch = None

        def set_epoch(self, epoch):
            self.epoch = epoch

    data = torch.utils.data.TensorDataset(torch.arange(8))
    sampler = EpochSampler(data)
    loader = torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler)
    DistributedDataset(loader, devices=["cpu:0"]).set_epoch(3)
    assert sampler.epoch == 3
    DistributedDataset(global_batches([4]), devices=["cpu:0"]).set_epoch(3)  # nothing to set: no error
