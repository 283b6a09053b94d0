"""The distinct ids of a batch, where each id sits among them, and how often it occurs.

``torch.unique`` on a CPU int64 tensor sorts with torch's CPU sort, which above 2,048
elements is 2-4x slower than numpy's ``argsort`` (x86-simd-sort where the CPU has it):
6,656 ids (a DLRM batch of 256 x 26 features) took 271 us against 125 us for the same
result from numpy's sort, and ``torch.unique`` was 7% of a one-device DLRM step
(``benchmarks/RESULTS.md``, 'A table's distinct ids and hashing through numpy'). Below that
size torch's one call beats numpy's dozen (about 13 us), so small batches keep it.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["NUMPY_FROM", "distinct_ids", "distinct_ids_and_counts"]

NUMPY_FROM = 2048
"""Above this many ids the numpy sort is used (measured crossover on this machine: 1,600 ids
0.57x torch's speed, 3,200 ids 1.66x)."""


def _by_numpy(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    values = ids.numpy()
    order = values.argsort()
    ordered = values[order]
    first = np.empty(ordered.shape, dtype=bool)
    first[:1] = True
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    inverse = np.empty(values.shape, dtype=np.int64)
    inverse[order] = np.cumsum(first) - 1
    counts = np.diff(np.flatnonzero(first), append=values.size)
    return torch.from_numpy(ordered[first]), torch.from_numpy(inverse), torch.from_numpy(counts)


def _uses_numpy(ids: torch.Tensor) -> bool:
    return ids.numel() > NUMPY_FROM and ids.dtype == torch.int64 and ids.device.type == "cpu"


def distinct_ids(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.unique(ids, return_inverse=True)``: the sorted distinct ids, and each id's place
    among them (in ``ids``' shape)."""
    if not _uses_numpy(ids):
        return torch.unique(ids, return_inverse=True)
    unique, inverse, _ = _by_numpy(ids.detach().reshape(-1))
    return unique, inverse.reshape(ids.shape)


def distinct_ids_and_counts(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.unique(ids, return_inverse=True, return_counts=True)``: with how often each distinct id occurs."""
    if not _uses_numpy(ids):
        return torch.unique(ids, return_inverse=True, return_counts=True)
    unique, inverse, counts = _by_numpy(ids.detach().reshape(-1))
    return unique, inverse.reshape(ids.shape), counts
