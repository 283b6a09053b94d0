"""The pure sharding arithmetic: every sample exactly once, every worker the same steps."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unison._input.sharding import (
    epoch_order,
    exposes_files,
    num_steps,
    shard_files,
    shard_rows,
    split_sizes,
    split_slices,
    worker_batches,
    worker_slice,
)


def test_split_sizes_gives_extra_rows_to_the_first_parts():
    assert split_sizes(5, 3) == (2, 2, 1)
    assert split_sizes(1, 3) == (1, 0, 0)
    assert split_sizes(0, 2) == (0, 0)
    assert split_slices(5, 2, start=10) == (slice(10, 13), slice(13, 15))


def test_shard_rows_two_workers_two_replicas():
    # 6 rows: worker 0 keeps 0..2 (2 + 1), worker 1 keeps 3..5 (2 + 1).
    assert shard_rows(6, 2, 0, 2) == (slice(0, 2), slice(2, 3))
    assert shard_rows(6, 2, 1, 2) == (slice(3, 5), slice(5, 6))
    # A last batch of 2 rows: one row per worker, the second replica of each gets none.
    assert shard_rows(2, 2, 0, 2) == (slice(0, 1), slice(1, 1))
    assert shard_rows(2, 2, 1, 2) == (slice(1, 2), slice(2, 2))


@settings(max_examples=200)
@given(total=st.integers(0, 60), workers=st.integers(1, 4), replicas=st.integers(1, 4))
def test_shard_rows_partitions_the_batch_in_global_replica_order(total, workers, replicas):
    slices = [s for w in range(workers) for s in shard_rows(total, workers, w, replicas)]
    rows = [i for s in slices for i in range(total)[s]]
    assert rows == list(range(total))  # contiguous, in order, each row once
    sizes = [s.stop - s.start for s in slices]
    assert max(sizes) - min(sizes) <= 1


@settings(max_examples=200)
@given(
    num_samples=st.integers(0, 80),
    global_batch=st.integers(1, 16),
    workers=st.integers(1, 4),
    shuffle=st.booleans(),
    epoch=st.integers(0, 3),
    drop_last=st.booleans(),
)
def test_worker_batches_cover_every_sample_once_with_equal_steps(num_samples, global_batch, workers, shuffle, epoch,
                                                                  drop_last):
    order = epoch_order(num_samples, shuffle=shuffle, seed=7, epoch=epoch)
    per_worker = [list(worker_batches(order, global_batch, workers, w, drop_last=drop_last)) for w in range(workers)]
    steps = num_steps(num_samples, global_batch, drop_last)
    assert all(len(batches) == steps for batches in per_worker)
    seen = [i for batches in per_worker for batch in batches for i in batch]
    kept = num_samples - (num_samples % global_batch if drop_last else 0)
    assert sorted(seen) == sorted(order[:kept])
    assert len(set(seen)) == len(seen)
    for step in range(steps):  # a step's shares, worker by worker, are that global batch
        joined = [i for w in range(workers) for i in per_worker[w][step]]
        assert joined == order[step * global_batch : (step + 1) * global_batch]


def test_epoch_order_is_reproducible_and_changes_per_epoch():
    assert epoch_order(5, shuffle=False, seed=0, epoch=3) == [0, 1, 2, 3, 4]
    a = epoch_order(50, shuffle=True, seed=1, epoch=0)
    assert a == epoch_order(50, shuffle=True, seed=1, epoch=0)
    assert a != epoch_order(50, shuffle=True, seed=1, epoch=1)
    assert sorted(a) == list(range(50))


def test_num_steps():
    assert num_steps(10, 4, drop_last=False) == 3
    assert num_steps(10, 4, drop_last=True) == 2
    assert num_steps(8, 4, drop_last=False) == 2
    assert num_steps(0, 4, drop_last=False) == 0


@settings(max_examples=100)
@given(files=st.integers(1, 20), workers=st.integers(1, 5))
def test_shard_files_partitions_files_round_robin(files, workers):
    names = [f"part-{i}" for i in range(files)]
    if files < workers:
        with pytest.raises(ValueError, match=rf"FILE sharding needs at least one file per worker, "
                                             rf"got {files} files for {workers} workers: use AutoShardPolicy.DATA"):
            shard_files(names, workers, 0)
        return
    shards = [shard_files(names, workers, w) for w in range(workers)]
    assert sorted(n for s in shards for n in s) == sorted(names)
    assert shards[0][:1] == ["part-0"]
    assert all(s == names[w::workers] for w, s in enumerate(shards))


def test_shard_files_rejects_a_single_path():
    with pytest.raises(TypeError, match=r"`files` must be a sequence of paths, got a single path 'data.csv'"):
        shard_files("data.csv", 1, 0)


def test_worker_index_out_of_range():
    with pytest.raises(ValueError, match=r"`worker_index` 2 is out of range for num_workers=2 \(valid 0\.\.1\)"):
        worker_slice(10, 2, 2)


def test_exposes_files_needs_both_members():
    class Files:
        files = ["a"]

        def with_files(self, files):
            return []

    class OnlyFiles:
        files = ["a"]

    assert exposes_files(Files())
    assert not exposes_files(OnlyFiles())
    assert not exposes_files([1, 2])
