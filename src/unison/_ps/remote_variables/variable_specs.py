"""What travels to a worker in place of a ps variable's values: where it lives."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Placement", "VariableSpec", "task_device", "is_metadata_function"]


def task_device(task: int) -> str:
    """The TF device name of ps task ``task``, e.g. ``"/job:ps/replica:0/task:1"``."""
    return f"/job:ps/replica:0/task:{task}"


@dataclasses.dataclass(frozen=True)
class Placement:
    """One tensor on one ps task: the whole variable, or one shard of it."""

    task: int
    key: str
    rows: int


@dataclasses.dataclass(frozen=True)
class VariableSpec:
    """A ps variable: its name, shape, dtype and where its parts (one, or one per shard) live."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    parts: tuple[Placement, ...]
    sharded: bool

    @property
    def key(self) -> str:
        """The key of the first part (a worker's cache key for the whole variable)."""
        return self.parts[0].key

    def part_shape(self, index: int) -> tuple[int, ...]:
        """Shape of part ``index``."""
        return (self.parts[index].rows,) + self.shape[1:]

    def row_starts(self) -> list[int]:
        """First global row of each part."""
        starts, total = [], 0
        for part in self.parts:
            starts.append(total)
            total += part.rows
        return starts


_METADATA_METHODS = frozenset({
    "size", "dim", "numel", "requires_grad_", "is_floating_point", "is_complex", "element_size", "stride",
    "nelement", "ndimension", "is_contiguous", "__hash__", "__len__", "get_device", "type", "__format__",
})


def is_metadata_function(func: Callable[..., Any]) -> bool:
    """Whether ``func`` only looks at a tensor's metadata (shape, dtype, grad...), never its values."""
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):
        return getattr(getattr(func, "__self__", None), "__name__", "") != "data"
    return name in _METADATA_METHODS
