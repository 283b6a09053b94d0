"""A hash index from int64 ids to row slots, held in one array and probed batch-wise.

A dynamic table resolves a batch of thousands of ids per call. A Python dict costs a
boxed int and a dict probe per id (over 100 bytes an id); a sorted id array with
``torch.searchsorted`` costs about twenty dependent memory reads per id. This is an
open-addressing table with linear probing whose entries are ``(id, slot)`` pairs in one
``[capacity, 2]`` int64 array (the id and its slot share a cache line), and every probe
round is a handful of vectorised ops over the ids still unresolved. The load (live
entries plus tombstones) is kept at most one half, so most ids resolve on their first
probe; any int64 is a valid id, so emptiness is marked in the slot column, never by a
key value.

The probe rounds run in numpy over the tensors' memory (no copy either way): a batch
takes ten to twenty rounds to resolve its longest chain, each a dozen small ops, and
numpy's per-op cost is about a third of torch's, which made a lookup of 2,048 ids
3.4x faster and one of 150 ids 7x (``benchmarks/RESULTS.md``, the disk tier).
"""

from __future__ import annotations

from typing import final

import numpy as np
import torch

from unison._embeddings.tables.id_hashing import splitmix64_in_place

__all__ = ["IdIndex"]

_EMPTY = -1  # never used: a probe for any id stops here
_TOMBSTONE = -2  # removed: probes continue past it, an insert may reuse it
_MIN_CAPACITY = 16
_WINDOW = 16  # entries a probe round reads per id once few ids are left: a tail of long chains
_WINDOW_BELOW = 256  # ids left under which rounds read windows (above it, one entry each is cheaper)
_STEPS = np.arange(_WINDOW)


def _home(ids: np.ndarray, mask: int) -> np.ndarray:
    """Where each id's probe starts: SplitMix64's finaliser of its bits (``id_hashing.splitmix64``, in
    numpy's wrapping uint64 arithmetic) masked to the table."""
    return splitmix64_in_place(ids.view(np.uint64).copy()).view(np.int64) & mask


def _blank(capacity: int) -> torch.Tensor:
    table = torch.zeros(capacity, 2, dtype=torch.int64)
    table[:, 1] = _EMPTY
    return table


def _array(ids: torch.Tensor) -> np.ndarray:
    """A 1-D int64 tensor's memory as a numpy array (copied only if it is not contiguous)."""
    if ids.dtype != torch.int64:
        raise TypeError(f"IdIndex needs int64 ids and slots, got dtype {ids.dtype}; fix: pass ids.long()")
    return ids.detach().contiguous().numpy()


@final
class IdIndex:
    """Maps distinct int64 ids to non-negative int64 slots; not thread-safe."""

    def __init__(self) -> None:
        self._set_table(_blank(_MIN_CAPACITY))
        self._live = 0
        self._tombstones = 0

    def _set_table(self, table: torch.Tensor) -> None:
        self._table = table
        self._entries = table.numpy()  # the same memory

    def __len__(self) -> int:
        return self._live

    @property
    def nbytes(self) -> int:
        """Bytes held by the index tensor."""
        return self._table.numel() * self._table.element_size()

    def _locate(self, ids: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(position in the table, slot, end)`` of each id: position and slot -1 where the id is
        absent, and there ``end`` is where it may go: the first tombstone its probe passed, else
        the empty entry the probe stopped at (reusing tombstones keeps a table whose rows come
        and go, such as a disk tier's hot rows, from filling with them and lengthening probes).

        A round reads one entry per unresolved id while many are left; the last few ids, on
        the longest chains, read ``_WINDOW`` entries at once, so a batch's tail of chains 10
        to 30 entries long costs two or three rounds instead of twenty."""
        entries = self._entries
        mask = entries.shape[0] - 1
        keys = _array(ids)
        found_pos, found_slot = np.full(keys.shape[0], -1, np.int64), np.full(keys.shape[0], -1, np.int64)
        end = np.full(keys.shape[0], -1, np.int64)
        todo = np.arange(keys.shape[0])
        pos = _home(keys, mask)
        tombstones = self._tombstones > 0
        while todo.size > _WINDOW_BELOW:
            entry = entries.take(pos, axis=0)  # ``take``: a tenth of the time of ``entries[pos]``
            slot = entry[:, 1]
            hit = (slot >= 0) & (entry[:, 0] == keys)
            empty = slot == _EMPTY
            if hit.any():
                at = todo[hit]
                found_pos[at] = pos[hit]
                found_slot[at] = slot[hit]
            if tombstones:  # the first tombstone on the probe: the end, unless the id is found later
                first = (slot == _TOMBSTONE) & (end.take(todo) < 0)
                end[todo[first]] = pos[first]
                empty &= end.take(todo) < 0
            if empty.any():
                end[todo[empty]] = pos[empty]
            go_on = ~(hit | (slot == _EMPTY))
            todo, keys, pos = todo[go_on], keys[go_on], (pos[go_on] + 1) & mask
        while todo.size:
            window = (pos[:, None] + _STEPS) & mask
            entry = entries.take(window, axis=0)  # [ids, _WINDOW, 2]
            slot = entry[:, :, 1]
            hit = (slot >= 0) & (entry[:, :, 0] == keys[:, None])
            stop = hit | (slot == _EMPTY)
            stopped = stop.any(axis=1)
            at = stop.argmax(axis=1)  # where a stopped probe ends in its window
            if tombstones:  # tombstones passed before the probe stops (or in the whole window)
                passed = (slot == _TOMBSTONE) & (~stopped[:, None] | (_STEPS < at[:, None]))
                first = passed.any(axis=1) & (end.take(todo) < 0)
                rows = first.nonzero()[0]
                end[todo[rows]] = window[rows, passed[rows].argmax(axis=1)]
            rows = stopped.nonzero()[0]
            stop_pos, stop_hit = window[rows, at[rows]], hit[rows, at[rows]]
            found = rows[stop_hit]
            found_pos[todo[found]] = stop_pos[stop_hit]
            found_slot[todo[found]] = slot[found, at[found]]
            absent = todo[rows[~stop_hit]]
            unset = end.take(absent) < 0
            end[absent[unset]] = stop_pos[~stop_hit][unset]
            go_on = ~stopped
            todo, keys, pos = todo[go_on], keys[go_on], (pos[go_on] + _WINDOW) & mask
        if tombstones:
            end[found_pos >= 0] = -1
        return found_pos, found_slot, end

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """The slot of each id of a 1-D int64 tensor, -1 where it is absent."""
        return torch.from_numpy(self._locate(ids)[1])

    def find_with_ends(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``find``, and for each absent id the entry its probe ended at: pass those to
        :meth:`insert` as ``hint`` and the insert starts there instead of probing again."""
        _, slots, end = self._locate(ids)
        return torch.from_numpy(slots), torch.from_numpy(end)

    def insert(self, ids: torch.Tensor, slots: torch.Tensor, hint: torch.Tensor | None = None) -> None:
        """Add distinct ids, none of them present, with their slots (both 1-D int64).

        ``hint``: where each id's probe ended in a ``find_with_ends`` since the index last
        changed (ignored when this insert grows the table, which moves every entry).
        """
        if (self._live + self._tombstones + ids.numel()) * 2 > self._entries.shape[0]:
            self._rebuild(self._live + ids.numel())
            hint = None
        self._place(_array(ids), _array(slots), None if hint is None else _array(hint))

    def remove(self, ids: torch.Tensor) -> None:
        """Drop distinct ids that are all present."""
        pos = self._locate(ids)[0]
        if bool((pos < 0).any()):
            raise KeyError(f"IdIndex.remove: ids {_array(ids)[pos < 0][:8].tolist()} are not in the index")
        self._entries[pos, 1] = _TOMBSTONE
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
        self._set_table(_blank(capacity))
        self._live = self._tombstones = 0
        self._place(ids.numpy(), slots.numpy())

    def _place(self, ids: np.ndarray, slots: np.ndarray, start: np.ndarray | None = None) -> None:
        """Linear-probe insert of a batch: ids that reach the same free entry race for it,
        the one whose key stays written there wins, the others probe on. ``start``: where
        each id's probe begins (default its hash; a probe's end is as good: every entry
        before it on the id's chain is taken)."""
        entries = self._entries
        mask = entries.shape[0] - 1
        self._live += ids.shape[0]
        pos = _home(ids, mask) if start is None else start.copy()
        while ids.size:
            was = entries.take(pos, axis=0)[:, 1]
            free = was < 0
            entries[pos[free], 0] = ids[free]
            won = free.copy()
            won[free] = entries[pos[free], 0] == ids[free]
            entries[pos[won], 1] = slots[won]
            self._tombstones -= int((was[won] == _TOMBSTONE).sum())
            lost = ~won
            ids, slots, pos = ids[lost], slots[lost], (pos[lost] + 1) & mask
