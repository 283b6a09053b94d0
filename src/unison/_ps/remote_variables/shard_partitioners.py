"""Partitioners: how many shards a parameter-server variable is split into.

A partitioner is called as ``partitioner(shape, dtype)`` and returns the number of
shards along each axis; only axis 0 is ever split (the rows of an embedding table, the
output features of a linear layer). The numbers are TensorFlow's, so a model ported
from ``tf.distribute.experimental.partitioners`` shards the same way.

tf.distribute equivalent: ``tf.distribute.experimental.partitioners``
(``FixedShardsPartitioner``, ``MinSizePartitioner``, ``MaxSizePartitioner``).
Difference: ``num_shards`` of FixedShardsPartitioner is checked (TF accepts 0).
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["Partitioner", "FixedShardsPartitioner", "MinSizePartitioner", "MaxSizePartitioner", "shard_rows"]


def _positive(value: Any, field: str, owner: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner}: `{field}` must be an int, got {type(value).__name__}: {value!r}")
    if value < 1:
        raise ValueError(f"{owner}: `{field}` must be positive, got {value!r}; pass an int >= 1")
    return value


def _shape(shape: Any) -> tuple[int, ...]:
    dims = tuple(int(d) for d in shape)
    if not dims:
        raise ValueError(
            f"cannot partition a scalar: shape {tuple(shape)!r} has no axis 0; do not pass a partitioner for it"
        )
    if any(d < 0 for d in dims):
        raise ValueError(f"shape {dims!r} has a negative dimension")
    return dims


def _element_size(dtype: Any, bytes_per_string: int) -> int:
    if isinstance(dtype, torch.dtype):
        return dtype.itemsize
    if dtype is str or dtype == "string":  # TF's string tensors; kept for ported code
        return bytes_per_string
    raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")


def shard_rows(rows: int, num_shards: int) -> list[int]:
    """Rows of each shard when ``rows`` are split in ``num_shards``: the first ``rows % n`` get one more.

    Example:
        >>> shard_rows(10, 3)
        [4, 3, 3]
    """
    base, extra = divmod(rows, num_shards)
    return [base + (1 if i < extra else 0) for i in range(num_shards)]


class Partitioner(abc.ABC):
    """Decides the shards of a variable (``tf.distribute.experimental.partitioners.Partitioner``)."""

    @abc.abstractmethod
    def __call__(self, shape: Sequence[int], dtype: torch.dtype) -> list[int]:
        """Number of shards along each axis of a variable of ``shape`` and ``dtype``."""


class FixedShardsPartitioner(Partitioner):
    """Splits axis 0 into ``num_shards`` shards (fewer when it has fewer rows).

    Example:
        >>> FixedShardsPartitioner(2)([10, 3], torch.float32)
        [2, 1]

    Raises:
        ValueError: if ``num_shards`` is not positive.
    """

    def __init__(self, num_shards: int):
        self._num_shards = _positive(num_shards, "num_shards", "FixedShardsPartitioner")

    def __call__(self, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> list[int]:
        dims = _shape(shape)
        return [min(self._num_shards, dims[0])] + [1] * (len(dims) - 1)

    def __repr__(self) -> str:
        return f"FixedShardsPartitioner(num_shards={self._num_shards})"


class MinSizePartitioner(Partitioner):
    """As many shards as keep each at least ``min_shard_bytes``, at most ``max_shards``.

    Example:
        >>> MinSizePartitioner(min_shard_bytes=8, max_shards=10)([6, 1], torch.float32)
        [3, 1]

    Raises:
        ValueError: if an argument is not positive.
    """

    def __init__(self, min_shard_bytes: int = 256 << 10, max_shards: int = 1, bytes_per_string: int = 16):
        self._min_shard_bytes = _positive(min_shard_bytes, "min_shard_bytes", "MinSizePartitioner")
        self._max_shards = _positive(max_shards, "max_shards", "MinSizePartitioner")
        self._bytes_per_string = _positive(bytes_per_string, "bytes_per_string", "MinSizePartitioner")

    def __call__(self, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> list[int]:
        dims = _shape(shape)
        total_bytes = math.prod(dims) * _element_size(dtype, self._bytes_per_string)
        wanted = int(math.ceil(total_bytes / self._min_shard_bytes))
        return [max(1, min(dims[0], self._max_shards, wanted))] + [1] * (len(dims) - 1)

    def __repr__(self) -> str:
        return f"MinSizePartitioner(min_shard_bytes={self._min_shard_bytes}, max_shards={self._max_shards})"


class MaxSizePartitioner(Partitioner):
    """As few shards as keep each at most ``max_shard_bytes`` (one row at least), at most ``max_shards``.

    Example:
        >>> MaxSizePartitioner(max_shard_bytes=100)([100, 3], torch.float32)
        [13, 1]

    Raises:
        ValueError: if an argument is not positive.
    """

    def __init__(self, max_shard_bytes: int, max_shards: int | None = None, bytes_per_string: int = 16):
        self._max_shard_bytes = _positive(max_shard_bytes, "max_shard_bytes", "MaxSizePartitioner")
        self._max_shards = None if max_shards is None else _positive(max_shards, "max_shards", "MaxSizePartitioner")
        self._bytes_per_string = _positive(bytes_per_string, "bytes_per_string", "MaxSizePartitioner")

    def __call__(self, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> list[int]:
        dims = _shape(shape)
        if dims[0] == 0:
            return [1] * len(dims)
        bytes_per_row = math.prod(dims[1:]) * _element_size(dtype, self._bytes_per_string)
        rows_per_shard = max(1, math.floor(self._max_shard_bytes / bytes_per_row)) if bytes_per_row else dims[0]
        shards = int(math.ceil(dims[0] / rows_per_shard))
        if self._max_shards:
            shards = min(self._max_shards, shards)
        return [shards] + [1] * (len(dims) - 1)

    def __repr__(self) -> str:
        return f"MaxSizePartitioner(max_shard_bytes={self._max_shard_bytes}, max_shards={self._max_shards})"
