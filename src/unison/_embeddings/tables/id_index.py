"""A hash index from int64 ids to row slots, held in torch tensors and probed batch-wise.

A dynamic table resolves a batch of thousands of ids per call. A Python dict costs a
boxed int and a dict probe per id; a sorted id array with ``torch.searchsorted`` costs
about twenty dependent memory reads per id. This is an open-addressing table with
linear probing whose entries are ``(id, slot)`` pairs in one ``[capacity, 2]`` int64
tensor (the id and its slot share a cache line), and every probe round is a handful of
vectorised torch ops over the ids still unresolved. The load (live entries plus
tombstones) is kept at most one half, so most ids resolve on their first probe; any
int64 is a valid id, so emptiness is marked in the slot column, never by a key value.
"""

from __future__ import annotations

from typing import final

import torch

from unison._embeddings.tables.id_hashing import splitmix64

__all__ = ["IdIndex"]

_EMPTY = -1  # never used: a probe for any id stops here
_TOMBSTONE = -2  # removed: probes continue past it, an insert may reuse it
_MIN_CAPACITY = 16


def _blank(capacity: int) -> torch.Tensor:
    table = torch.zeros(capacity, 2, dtype=torch.int64)
    table[:, 1] = _EMPTY
    return table


@final
class IdIndex:
    """Maps distinct int64 ids to non-negative int64 slots; not thread-safe."""

    def __init__(self) -> None:
        self._table = _blank(_MIN_CAPACITY)
        self._live = 0
        self._tombstones = 0

    def __len__(self) -> int:
        return self._live

    @property
    def nbytes(self) -> int:
        """Bytes held by the index tensor."""
        return self._table.numel() * self._table.element_size()

    def _locate(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(position in the table, slot, end)`` of each id: position and slot -1 where the id is
        absent, and there ``end`` is the empty entry its probe stopped at (where it may go)."""
        mask = self._table.shape[0] - 1
        found_pos, found_slot = torch.full_like(ids, -1), torch.full_like(ids, -1)
        end = torch.full_like(ids, -1)
        todo = torch.arange(ids.numel())
        keys = ids
        pos = splitmix64(ids) & mask
        while todo.numel():
            entry = self._table.index_select(0, pos)
            slot = entry[:, 1]
            hit = (slot >= 0) & (entry[:, 0] == keys)
            found_pos.index_copy_(0, todo, torch.where(hit, pos, -1))
            found_slot.index_copy_(0, todo, torch.where(hit, slot, -1))
            empty = slot == _EMPTY
            end.index_copy_(0, todo, torch.where(empty, pos, -1))
            go_on = (~hit & ~empty).nonzero().squeeze(1)
            todo, keys = todo.index_select(0, go_on), keys.index_select(0, go_on)
            pos = (pos.index_select(0, go_on) + 1) & mask
        return found_pos, found_slot, end

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """The slot of each id of a 1-D int64 tensor, -1 where it is absent."""
        return self._locate(ids)[1]

    def find_with_ends(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``find``, and for each absent id the entry its probe ended at: pass those to
        :meth:`insert` as ``hint`` and the insert starts there instead of probing again."""
        _, slots, end = self._locate(ids)
        return slots, end

    def insert(self, ids: torch.Tensor, slots: torch.Tensor, hint: torch.Tensor | None = None) -> None:
        """Add distinct ids, none of them present, with their slots (both 1-D int64).

        ``hint``: where each id's probe ended in a ``find_with_ends`` since the index last
        changed (ignored when this insert grows the table, which moves every entry).
        """
        if (self._live + self._tombstones + ids.numel()) * 2 > self._table.shape[0]:
            self._rebuild(self._live + ids.numel())
            hint = None
        self._place(ids, slots, hint)

    def remove(self, ids: torch.Tensor) -> None:
        """Drop distinct ids that are all present."""
        pos = self._locate(ids)[0]
        if bool((pos < 0).any()):
            raise KeyError(f"IdIndex.remove: ids {ids[pos < 0][:8].tolist()} are not in the index")
        self._table[pos, 1] = _TOMBSTONE
        self._live -= ids.numel()
        self._tombstones += ids.numel()

    def items(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids, slots)`` of every live entry, in table order."""
        live = self._table[:, 1] >= 0
        return self._table[live, 0], self._table[live, 1]

    def _rebuild(self, live: int) -> None:
        """Re-insert the live entries into the smallest table that holds ``live`` at half load or less.

        Half load keeps linear probes short (1.5 entries per hit on average) at 2-4 entries
        per id, 32-64 bytes: a quarter of a 64-wide float32 row, where the quarter load used
        before took twice that.

        An index whose ids also leave (eviction, a capacity: tombstones at the rebuild) gets
        room for at least ``live / 4`` more inserts before the next rebuild: at a steady size
        just under a power of two, the smallest table would fill with tombstones within a
        step or two and be rebuilt whole each time (a 500k-row table under a capacity spent
        ~90% of a step there). The doubling costs 2.5-5 entries per id where it applies.
        """
        capacity = _MIN_CAPACITY
        while live * 2 > capacity:
            capacity *= 2
        if self._tombstones and (capacity // 2 - live) * 4 < live:
            capacity *= 2
        ids, slots = self.items()
        self._table = _blank(capacity)
        self._live = self._tombstones = 0
        self._place(ids, slots)

    def _place(self, ids: torch.Tensor, slots: torch.Tensor, start: torch.Tensor | None = None) -> None:
        """Linear-probe insert of a batch: ids that reach the same free entry race for it,
        the one whose key stays written there wins, the others probe on. ``start``: where
        each id's probe begins (default its hash; a probe's end is as good: every entry
        before it on the id's chain is taken)."""
        mask = self._table.shape[0] - 1
        self._live += ids.numel()
        pos = splitmix64(ids) & mask if start is None else start.clone()
        while ids.numel():
            was = self._table.index_select(0, pos)[:, 1]
            free = was < 0
            self._table[pos[free], 0] = ids[free]
            won = free.clone()
            won[free] = self._table[pos[free], 0] == ids[free]
            self._table[pos[won], 1] = slots[won]
            self._tombstones -= int((was[won] == _TOMBSTONE).sum())
            lost = ~won
            ids, slots, pos = ids[lost], slots[lost], (pos[lost] + 1) & mask
