"""Partitioners give TensorFlow's shard counts and reject bad arguments by name."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from unison._ps.remote_variables.shard_partitioners import (
    FixedShardsPartitioner,
    MaxSizePartitioner,
    MinSizePartitioner,
    shard_rows,
)


@pytest.mark.parametrize("partitioner, shape, expected", [
    (FixedShardsPartitioner(2), [10, 3], [2, 1]),
    (FixedShardsPartitioner(3), [2, 5], [2, 1]),
    (MinSizePartitioner(min_shard_bytes=8, max_shards=10), [6, 1], [3, 1]),
    (MinSizePartitioner(min_shard_bytes=4, max_shards=2), [6, 1], [2, 1]),
    (MinSizePartitioner(), [1000, 64], [1, 1]),
    (MinSizePartitioner(max_shards=4), [1024, 256], [4, 1]),
    (MaxSizePartitioner(max_shard_bytes=100), [100, 3], [13, 1]),
    (MaxSizePartitioner(max_shard_bytes=100, max_shards=4), [100, 3], [4, 1]),
    (MaxSizePartitioner(max_shard_bytes=4), [10, 3], [10, 1]),
])
def test_tensorflow_numbers(partitioner, shape, expected):
    assert partitioner(shape, torch.float32) == expected


def test_dtype_size_counts():
    assert MinSizePartitioner(min_shard_bytes=8, max_shards=10)([6, 1], torch.float64) == [6, 1]
    assert MaxSizePartitioner(max_shard_bytes=100)([100, 3], torch.float16) == [7, 1]


@pytest.mark.parametrize("make, field", [
    (lambda: FixedShardsPartitioner(0), "num_shards"),
    (lambda: MinSizePartitioner(min_shard_bytes=0), "min_shard_bytes"),
    (lambda: MinSizePartitioner(max_shards=-1), "max_shards"),
    (lambda: MinSizePartitioner(bytes_per_string=0), "bytes_per_string"),
    (lambda: MaxSizePartitioner(max_shard_bytes=0), "max_shard_bytes"),
    (lambda: MaxSizePartitioner(100, max_shards=0), "max_shards"),
])
def test_non_positive_arguments_name_the_argument(make, field):
    with pytest.raises(ValueError, match=f"`{field}` must be positive"):
        make()


def test_scalar_cannot_be_partitioned():
    with pytest.raises(ValueError, match="scalar"):
        FixedShardsPartitioner(2)([], torch.float32)


@given(st.integers(0, 500), st.integers(1, 20))
def test_shard_rows_split(rows, n):
    sizes = shard_rows(rows, n)
    assert sum(sizes) == rows and len(sizes) == n
    assert sizes == sorted(sizes, reverse=True) and sizes[0] - sizes[-1] <= 1
    assert sizes[: rows % n] == [math.ceil(rows / n)] * (rows % n)


def test_partitioners_import_as_a_module_too():
    """`import unison.partitioners` (as users of tf.distribute.experimental.partitioners write) works."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", "import unison.partitioners as p; from unison.partitioners import "
                           "MaxSizePartitioner; print(p.FixedShardsPartitioner(2)([10, 3], 'float32'))"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[2, 1]"
