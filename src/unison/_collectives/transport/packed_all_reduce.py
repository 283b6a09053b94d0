"""Packed all-reduce across processes: many tensors, a few collectives, views back.

CollectiveAllReduce's batch path. The tensors are copied, in reverse order (the last
gradients computed travel first), into one flat buffer per dtype, cut into packs of
about ``bytes_per_pack`` bytes; each pack's all-reduce is launched as soon as its copy
is done, so copying the next pack overlaps the transfer of the previous ones, and every
pack is in flight at once. The results are views of the reduced buffers: no copy back.

Three things keep it close to one flat all-reduce of the same bytes
(``benchmarks/RESULTS.md``, 'Packed all-reduce rework' and 'Two concurrent packs on gloo'):

- with ``bytes_per_pack=0`` (unison chooses), a buffer of ``LANE_SPLIT_BYTES`` or more
  travels as two packs cut at the tensor boundary nearest its middle: gloo runs two
  collectives at once on its two worker threads, and the second copy overlaps the first
  transfer. Below that size two concurrent collectives lose to one;
- buffers are pooled: a buffer is reused once nothing else holds its storage (the caller
  dropped every result view), which saves faulting in fresh pages on every call;
- the result views are cut while the packs are in flight, and MEAN divides each
  reduced buffer once rather than each tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from unison._collectives.transport.flat_buffers import BufferPool, dtype_groups, fill, views_of
from unison._collectives.transport.packing import _group_sizes

__all__ = ["PackedAllReduce", "LANE_SPLIT_BYTES"]

LANE_SPLIT_BYTES = 4 << 20
"""Buffers this large go as two concurrent packs when ``bytes_per_pack`` is 0.

gloo runs two collectives at once on its two worker threads, which pays for large
buffers and loses badly for small ones (``benchmarks/RESULTS.md``, 'Two concurrent packs
on gloo'). NCCL runs collectives one after another; the split then only overlaps
the second copy with the first transfer.
"""

def _lanes(numels: list[int], itemsize: int, bytes_per_pack: int) -> list[tuple[int, int]]:
    """One dtype's packs, as ``[first, end)`` ranges of its tensors in launch order."""
    if bytes_per_pack > 0:
        return [(group[0], group[-1] + 1) for group in _group_sizes([n * itemsize for n in numels], bytes_per_pack)]
    total = sum(numels)
    if total * itemsize < LANE_SPLIT_BYTES or len(numels) < 2:
        return [(0, len(numels))]
    half, running, cut = total / 2, 0, 0
    while cut < len(numels) - 1 and abs(running + numels[cut] - half) <= abs(running - half):
        running += numels[cut]
        cut += 1
    cut = max(cut, 1)
    return [(0, cut), (cut, len(numels))]


class PackedAllReduce:
    """Sums (or averages) a list of dense tensors across processes in a few packed collectives.

    Args:
        bytes_per_pack: target bytes per pack (``CommunicationOptions.bytes_per_pack``);
            0 lets unison choose (one pack per dtype, two above ``LANE_SPLIT_BYTES``).
    """

    def __init__(self, bytes_per_pack: int = 0) -> None:
        self._bytes_per_pack = bytes_per_pack
        self._pool = BufferPool()

    def __call__(self, tensors: Sequence[torch.Tensor], device: torch.device,
                 launch: Callable[[torch.Tensor], Any], wait: Callable[[Any], None],
                 divisor: int = 1) -> list[torch.Tensor]:
        """Returns the reduced tensors, in input order, as views of pooled buffers on ``device``.

        Args:
            tensors: dense tensors; they are only read.
            device: where the packs live (the process group's device).
            launch: starts the in-place all-reduce of one pack, returning its work handle.
            wait: waits for a work handle (and turns failures into unison errors).
            divisor: every result is divided by it (MEAN); 1 leaves the sums.
        """
        groups = dtype_groups(tensors, reverse=True)  # last computed first
        results: list[torch.Tensor] = list(tensors)  # every entry is replaced below
        pending: list[tuple[Any, torch.Tensor]] = []
        divide_after: list[int] = []  # integer results: divided per tensor, into new tensors
        moved = False
        for slot, (dtype, members, sources) in enumerate(groups):
            if not _all_on(sources, device):
                sources, moved = [t.to(device) for t in sources], True
            numels = [t.numel() for t in sources]
            buffer = self._pool.take(sum(numels), dtype, device, slot)
            # N-d: shaped views first, filled by one foreach copy per pack; 1-d: cut while the
            # packs travel. Their values are final once the waits below return.
            one_dimensional = all(t.dim() == 1 for t in sources)
            views = None if one_dimensional else views_of(buffer, sources)
            start = 0
            for first, end in _lanes(numels, dtype.itemsize, self._bytes_per_pack):
                size = sum(numels[first:end])
                pack = buffer[start:start + size]
                fill(pack, sources[first:end], None if views is None else views[first:end])
                pending.append((launch(pack), pack))
                start += size
            for index, piece in zip(members, views_of(buffer, sources) if views is None else views):
                results[index] = piece
            if divisor != 1 and not (dtype.is_floating_point or dtype.is_complex):
                divide_after.extend(members)
        self._pool.end_call()
        for work, pack in pending:
            wait(work)
            if divisor != 1 and (pack.is_floating_point() or pack.is_complex()):
                pack.div_(divisor)
        for index in divide_after:
            results[index] = results[index] / divisor
        if moved:
            results = [r if r.device == t.device else r.to(t.device) for r, t in zip(results, tensors)]
        return results


def _all_on(tensors: Sequence[torch.Tensor], device: torch.device) -> bool:
    """Whether every tensor already lives on ``device`` (cheap flags, no device objects)."""
    if device.type == "cpu":
        return all(t.is_cpu for t in tensors)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return all(t.is_cuda and t.get_device() == index for t in tensors)
