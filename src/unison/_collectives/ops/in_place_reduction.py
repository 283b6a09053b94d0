"""CPU replicas' gradients reduced in place, by every replica thread at once when they are large.

The replicas of one worker share the host's memory: replica 0's gradient becomes the
sum of every replica's (added in replica order), is divided for MEAN, and is copied into
the others' -- the same arithmetic as ``ReductionToOneDevice``, with nothing allocated.

A merge runs in one thread while the other replicas wait, so reducing millions of
gradient elements there leaves the other cores idle (for W1, the whole gap between
Mirrored and two threads training on their own: ``benchmarks/RESULTS.md``, 'Replica
reduction split across threads'). From ``SPLIT_MIN_ELEMENTS`` on,
the merge only collects the tensors, and each replica reduces its own slice of every
one, in its own thread, after the merge; the replicas then meet once more, since each
reads its whole gradient afterwards. Elementwise, so the result is bit for bit the same.
"""

from __future__ import annotations

import typing
from collections.abc import Sequence

import torch

__all__ = ["InPlaceReduction", "SPLIT_MIN_ELEMENTS"]

SPLIT_MIN_ELEMENTS = 1 << 18
"""Elements from which the replicas reduce their slices in parallel. Below, the extra
meeting of the replicas (two thread wake-ups) costs more than halving a memory-bound
pass over a few MB saves (``benchmarks/RESULTS.md``, 'Replica reduction split across
threads')."""


_INVERSE_POWERS_OF_TWO: dict[int, torch.Tensor] = {
    1 << k: torch.tensor(1.0 / (1 << k), dtype=torch.float32, device="cpu") for k in range(1, 11)}
"""``1 / n`` as a 0-dim float32 CPU tensor, by power of two ``n`` (up to 1,024 replicas). A
Python float factor is wrapped in a new tensor at every call: the mean's multiply over a
weight and a bias took 11 us against 4 us with the tensor (2-core VM, ``_foreach_mul_``).
``1 / 2**k`` is exact in every float format, so the product is the same to the bit (tested
for each dtype), and a 0-dim tensor takes each gradient's dtype. Made at import, so that
no mode active during a step (a fake-tensor trace, a default device) makes one."""


@typing.final
class InPlaceReduction:
    """The gradients of one merge, each as every replica's tensor of it.

    Args:
        num_replicas: the replicas whose tensors each ``add`` gets, in replica order.
        mean: divide the sum by ``num_replicas`` (else keep the sum).
    """

    def __init__(self, num_replicas: int, mean: bool):
        self._num_replicas = num_replicas
        self._mean = mean
        self._groups: list[Sequence[torch.Tensor]] = []
        self._elements = 0
        self._contiguous = True

    def add(self, per_replica: Sequence[torch.Tensor]) -> None:
        """Adds one gradient: every replica's tensor of it (same shape), in replica order."""
        self._groups.append(per_replica)
        self._elements += per_replica[0].numel()
        if self._contiguous:
            self._contiguous = all(t.is_contiguous() for t in per_replica)

    @property
    def split(self) -> bool:
        """Whether the replicas should reduce slices each: enough elements to pay the meeting,
        and every tensor contiguous (a slice is a range of its flat view)."""
        return self._elements >= SPLIT_MIN_ELEMENTS and self._contiguous

    def run(self, replica_id: int | None = None) -> None:
        """Reduces replica ``replica_id``'s slice of every gradient, or all of them for None."""
        groups = self._groups
        if not groups:
            return
        n = self._num_replicas
        if replica_id is not None:
            parts: list[Sequence[torch.Tensor]] = []
            for group in groups:
                size = group[0].numel()
                start, end = size * replica_id // n, size * (replica_id + 1) // n
                if end > start:
                    parts.append([t.view(-1)[start:end] for t in group])
            groups = parts
            if not groups:
                return
        firsts = [group[0] for group in groups]
        for k in range(1, n):
            torch._foreach_add_(firsts, [group[k] for group in groups])
        if self._mean:
            if n & (n - 1) == 0:  # x * (1 / 2**k) is x / 2**k exactly, and multiplies faster
                torch._foreach_mul_(firsts, _INVERSE_POWERS_OF_TWO.get(n, 1.0 / n))
            else:
                torch._foreach_div_(firsts, float(n))
        for k in range(1, n):
            torch._foreach_copy_([group[k] for group in groups], firsts)
