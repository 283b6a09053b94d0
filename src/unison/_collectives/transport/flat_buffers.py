"""Flat buffers that carry many tensors: grouping by dtype, filling, viewing, pooling.

Both batch all-reduce transports (packed gloo/NCCL collectives and shared memory) copy
a list of tensors into one flat buffer per dtype, reduce it, and hand back views of the
result. These are the pieces they share.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from unison._interpose.torch_private import storage_use_count, unflatten_dense_tensors

__all__ = ["BufferPool", "dtype_groups", "fill", "views_of"]

class BufferPool:
    """Flat buffers of the latest call, reused when nothing outside holds them any more.

    A buffer is handed out again only if its storage has no user but the pool: every
    view given to a caller, and every tensor autograd saved from one, holds a use. The
    pool keeps the buffers of the latest call only, so it never holds more memory than
    one call's results. Where torch does not count a storage's users
    (``_interpose/torch_private.py``), nothing is pooled.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], tuple[torch.Tensor, int | None]] = {}
        self._used: dict[tuple[Any, ...], tuple[torch.Tensor, int | None]] = {}

    def take(self, numel: int, dtype: torch.dtype, device: torch.device, slot: int) -> torch.Tensor:
        key = (numel, dtype, device, slot)
        entry = self._buffers.get(key)
        if entry is None or entry[1] is None or storage_use_count(entry[0]) != entry[1]:
            buffer = torch.empty(numel, dtype=dtype, device=device)
            entry = (buffer, storage_use_count(buffer))
        self._used[key] = entry
        return entry[0]

    def end_call(self) -> None:
        """Keeps only the buffers taken since the last ``end_call``."""
        self._buffers, self._used = self._used, {}


def dtype_groups(tensors: Sequence[torch.Tensor], reverse: bool = False
                 ) -> list[tuple[torch.dtype, list[int], list[torch.Tensor]]]:
    """``(dtype, positions, tensors)`` per dtype, in order of first appearance.

    ``reverse`` walks the tensors last to first (the order gradients are computed in).
    """
    count = len(tensors)
    order = range(count - 1, -1, -1) if reverse else range(count)
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) == 1:
        positions = list(order)
        return [(next(iter(dtypes)), positions, [tensors[i] for i in positions])]
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i in order:
        by_dtype.setdefault(tensors[i].dtype, []).append(i)
    return [(dtype, members, [tensors[i] for i in members]) for dtype, members in by_dtype.items()]


def views_of(buffer: torch.Tensor, sources: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of a flat ``buffer`` shaped like ``sources``, laid out one after another."""
    if all(t.dim() == 1 for t in sources):
        return list(buffer.split([t.numel() for t in sources]))
    return list(unflatten_dense_tensors(buffer, sources))


def fill(buffer: torch.Tensor, sources: Sequence[torch.Tensor], views: Sequence[torch.Tensor] | None = None) -> None:
    """Copies ``sources`` one after another into the flat ``buffer`` (exactly their size).

    1-d sources go through one ``cat``; N-d ones through one foreach copy into ``views``
    (``views_of(buffer, sources)``, computed here if not given): cheaper than a reshape
    per tensor.
    """
    with torch.no_grad():  # a reduction is not differentiable; cat(out=) refuses grad inputs
        if all(t.dim() == 1 for t in sources):
            torch.cat(list(sources), out=buffer)
        else:
            torch._foreach_copy_(list(views if views is not None else views_of(buffer, sources)), list(sources))
