"""The cold tier of a table shard: rows and optimizer state on disk, their ids and counters in memory.

Eviction policies and a capacity choose over every row of a table from its counters
(count, last step, idle seconds), every step; reading them from disk each time would
read the whole table. So a cold row keeps in memory what a policy reads (about 60
bytes: its id in an index, count, last step, last-touch time by the policy's clock, the
layout of its state) and the save epoch it last changed in (delta checkpoints and serving
exports hold the cold rows changed since a save), and on disk only its values and optimizer
state, one LMDB value per id. Its metadata lives by position, like a ``LocalTable``'s slots: positions of rows
deleted go to a free list for the next spill.

A row read back into memory is not deleted from disk (a delete is a B-tree write as costly
as a put): its copy stays as a **shadow**, stale once the row changes in memory, which the
row's next spill overwrites in place; a shadow is deleted only when its row leaves memory
for good (evicted, removed by a delta). Each id is recorded dirty once per seal (a position
remembers it was marked), not at every write.
"""

from __future__ import annotations

from typing import Any, final

import torch

from unison._embeddings.tables.disk.storage import KeyValueStore
from unison._embeddings.tables.id_index import IdIndex

__all__ = ["ColdRows"]

_MIN_CAPACITY = 16


@final
class ColdRows:
    """The rows of one shard that are on disk; not thread-safe (the tiered table's holder serialises calls).

    Args:
        store: the shard's key-value store (empty).
        embedding_dim, dtype: of the rows.
        clock: the eviction policy's clock, or None: then no idle time is kept.
    """

    def __init__(self, store: KeyValueStore, embedding_dim: int, dtype: torch.dtype, clock: Any) -> None:
        self._store, self._dim, self._dtype, self._clock = store, embedding_dim, dtype, clock
        self._itemsize = torch.empty(0, dtype=dtype).element_size()
        self._index = IdIndex()
        self._ids = torch.zeros(0, dtype=torch.int64)
        self._counts = torch.zeros(0, dtype=torch.int64)
        self._last_seen = torch.zeros(0, dtype=torch.int64)
        self._seen_at = torch.zeros(0, dtype=torch.float64)
        self._layout = torch.zeros(0, dtype=torch.int8)
        self._changed_in = torch.zeros(0, dtype=torch.int32)  # the hot table's save epoch (``LocalTable.take``)
        self._live = torch.zeros(0, dtype=torch.bool)  # the row is cold: its disk copy is the truth
        self._shadow = torch.zeros(0, dtype=torch.bool)  # the row is in memory; its disk copy is kept (stale)
        self._marked = torch.zeros(0, dtype=torch.bool)  # the id is recorded dirty since the last seal
        self._shadows = 0
        self.rows_lifted = 0  # rows read back into memory, ever (:meth:`lift`)
        self._free = torch.zeros(0, dtype=torch.int64)
        self._used = 0
        self._num_rows = 0
        # each distinct set of optimizer states the spilled rows had: ((name, columns), ...) and their initial values
        self._layouts: list[tuple[tuple[str, int], ...]] = []
        self.state_init: dict[str, float] = {}

    @property
    def num_rows(self) -> int:
        """Rows on disk."""
        return self._num_rows

    @property
    def nbytes(self) -> int:
        """Bytes in memory: the index and counters of the cold rows (not the store's page cache)."""
        per_slot = (self._ids, self._counts, self._last_seen, self._seen_at, self._layout, self._live,
                    self._changed_in, self._shadow, self._marked)
        used = sum(t[:self._used].numel() * t.element_size() for t in per_slot)
        return used + self._index.nbytes + self._free.numel() * self._free.element_size()

    @property
    def store(self) -> KeyValueStore:
        """The shard's key-value store."""
        return self._store

    @property
    def disk_bytes(self) -> int:
        """Bytes of the store's files on disk."""
        return self._store.disk_bytes

    @property
    def shadow_rows(self) -> int:
        """Rows in memory whose (stale) copy is kept on disk."""
        return self._shadows

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """Positions of the cold rows of ``ids``, -1 for the others."""
        if not self._num_rows:
            return torch.full_like(ids, -1)
        positions = self._index.find(ids)
        if self._shadows:
            positions[(positions >= 0) & ~self._live.index_select(0, positions.clamp(min=0))] = -1
        return positions

    def put(self, export: dict[str, Any]) -> None:
        """Writes the rows of a ``LocalTable.take(..., moving=True)`` (ids absent here) with their state; keeps
        their counters and the save epoch each changed in."""
        ids = export["ids"]
        if not ids.numel():
            return
        names = tuple(sorted(export["state"]))
        layout = tuple((name, int(export["state"][name].shape[1])) for name in names)
        if layout not in self._layouts:
            self._layouts.append(layout)
        self.state_init.update(export["meta"]["state_init"])
        values = torch.cat([export["rows"], *(export["state"][name] for name in names)], dim=1)
        positions = self._index.find(ids) if self._shadows else torch.full_like(ids, -1)
        shadows = positions >= 0  # written over in place
        self._shadow[positions[shadows]] = False
        self._shadows -= int(shadows.sum())
        fresh = (~shadows).nonzero().squeeze(1)
        positions[fresh] = self._allocate(fresh.numel())
        self._index.insert(ids.index_select(0, fresh), positions.index_select(0, fresh))
        self._store.put(ids, values.contiguous().view(torch.uint8), ids[~self._marked.index_select(0, positions)])
        self._marked[positions] = True
        self._ids[positions] = ids
        self._counts[positions] = export["counts"]
        self._last_seen[positions] = export["last_seen"]
        if self._clock is not None:
            self._seen_at[positions] = self._clock() - export["idle_seconds"].to(torch.float64)
        self._layout[positions] = self._layouts.index(layout)
        self._changed_in[positions] = export["changed_in"].to(torch.int32)
        self._live[positions] = True
        self._num_rows += ids.numel()

    def read(self, positions: torch.Tensor, meta: dict[str, Any]) -> list[dict[str, Any]]:
        """Exports of the rows at live ``positions``, one per state layout, with ``meta`` and ``"changed_in"``
        (rows stay here)."""
        out = []
        if len(self._layouts) == 1:  # one optimizer's rows: no grouping by layout
            groups = [(0, positions)]
        else:
            layouts = self._layout.index_select(0, positions)
            groups = [(code, positions[layouts == code]) for code in torch.unique(layouts).tolist()]
        for code, at in groups:
            layout = self._layouts[code]
            columns = self._dim + sum(c for _, c in layout)
            ids = self._ids.index_select(0, at)
            values = self._store.get(ids, columns * self._itemsize).view(self._dtype)
            state, start = {}, self._dim
            for name, width in layout:
                state[name] = values[:, start:start + width]
                start += width
            part = {"ids": ids, "rows": values[:, :self._dim], "state": state,
                    "counts": self._counts.index_select(0, at), "last_seen": self._last_seen.index_select(0, at),
                    "changed_in": self._changed_in.index_select(0, at).to(torch.int64),
                    "meta": {**meta, "state_init": {name: self.state_init[name] for name, _ in layout}}}
            if self._clock is not None:
                part["idle_seconds"] = self._clock() - self._seen_at.index_select(0, at)
            out.append(part)
        return out

    def lift(self, positions: torch.Tensor) -> None:
        """The rows at live ``positions`` were read back into memory: they are no longer cold; their copies
        stay on disk as shadows (nothing is written)."""
        self._live[positions] = False
        self._shadow[positions] = True
        self._num_rows -= positions.numel()
        self._shadows += positions.numel()
        self.rows_lifted += positions.numel()

    def remove(self, positions: torch.Tensor) -> None:
        """Deletes the rows at live ``positions`` from disk and memory."""
        if positions.numel():
            self._live[positions] = False
            self._num_rows -= positions.numel()
            self._delete(positions)

    def forget(self, ids: torch.Tensor) -> None:
        """Rows of ``ids`` left memory for good (evicted, removed): their shadow copies are deleted."""
        if not self._shadows or not ids.numel():
            return
        positions = self._index.find(ids)
        positions = positions[positions >= 0]
        positions = positions[self._shadow.index_select(0, positions)]
        if positions.numel():
            self._shadow[positions] = False
            self._shadows -= positions.numel()
            self._delete(positions)

    def _delete(self, positions: torch.Tensor) -> None:
        ids = self._ids.index_select(0, positions)
        self._store.delete(ids, ids[~self._marked.index_select(0, positions)])
        self._index.remove(ids)
        self._free = torch.cat([self._free, positions])

    def live_positions(self) -> torch.Tensor:
        """Positions of every row on disk."""
        return self._live[:self._used].nonzero().squeeze(1)

    def changed_positions(self, after: int) -> torch.Tensor:
        """Positions of the rows on disk that changed after save epoch ``after``."""
        used = self._used
        return ((self._changed_in[:used] > after) & self._live[:used]).nonzero().squeeze(1)

    def counters(self, positions: torch.Tensor) -> dict[str, torch.Tensor]:
        """``ids``, ``counts``, ``last_seen`` (and with a clock ``idle_seconds``) of ``positions``."""
        out = {"ids": self._ids.index_select(0, positions), "counts": self._counts.index_select(0, positions),
               "last_seen": self._last_seen.index_select(0, positions)}
        if self._clock is not None:
            out["idle_seconds"] = self._clock() - self._seen_at.index_select(0, positions)
        return out

    def seal(self) -> dict[str, Any] | None:
        """Seals the store (a full save is being taken) and returns what the save records to resume from
        it: the store's name and seal, and the ids on disk with their state layouts; None before the
        first spill (no store yet: nothing to resume)."""
        if not self._store.opened:
            return None
        live = self.live_positions()
        shadows = self._shadow[:self._used].nonzero().squeeze(1)
        seal = self._store.seal(self._ids.index_select(0, shadows))  # a resume deletes the shadows
        self._marked[:self._used] = False
        self._marked[shadows] = True
        return {"store": self._store.name, "seal": seal, "ids": self._ids.index_select(0, live),
                "layout": self._layout.index_select(0, live), "layouts": list(self._layouts)}

    def resume(self, sealed: dict[str, Any], export: dict[str, Any], pick: torch.Tensor,
               epoch: int) -> tuple[torch.Tensor, str | None]:
        """Keeps on disk the rows of a save that are still as they were (a restarted process resumes).

        ``sealed`` is what :meth:`seal` returned when ``export`` was taken; ``pick`` the positions
        of the export's rows this shard takes. The store it names is reopened if its seal is the
        save's (and the machine has not restarted); then its rows that the save had on disk, this
        shard takes, and that were not written or deleted since (not dirty) stay, their counters
        taken from ``export`` (changed in save epoch ``epoch``); every other row in the store
        (written after the save, or another shard's) is deleted. Returns the positions of
        ``pick`` still to load (the save's hot rows and those rolled back), and None; or ``pick``
        and why the files were not resumed (nothing changed).
        """
        if self._num_rows or self._shadows:
            return pick, "the table holds rows already"
        why = self._store.reopen(str(sealed["store"]), int(sealed["seal"]))
        if why is not None:
            return pick, why
        saved, dirty = sealed["ids"], self._store.dirty()
        wanted = export["ids"].index_select(0, pick)
        keep = torch.isin(saved, wanted) & ~torch.isin(saved, dirty)
        gone = torch.cat([saved[~keep], dirty])
        self._store.delete(gone, gone)
        kept = saved[keep]
        self._layouts = [tuple((str(name), int(columns)) for name, columns in layout) for layout in sealed["layouts"]]
        self.state_init.update(export["meta"]["state_init"])
        order = export["ids"].argsort()
        at = order.index_select(0, torch.searchsorted(export["ids"].index_select(0, order), kept))
        positions = self._allocate(kept.numel())
        self._ids[positions] = kept
        self._counts[positions] = export["counts"].index_select(0, at)
        self._last_seen[positions] = export["last_seen"].index_select(0, at)
        if self._clock is not None:
            idle = export.get("idle_seconds")
            now = self._clock()
            self._seen_at[positions] = now if idle is None else now - idle.to(torch.float64).index_select(0, at)
        self._layout[positions] = sealed["layout"][keep].to(torch.int8)
        self._changed_in[positions] = epoch
        self._live[positions] = True
        self._marked[positions] = False
        self._index.insert(kept, positions)
        self._num_rows += kept.numel()
        return pick[~torch.isin(wanted, kept)], None

    def close(self, remove: bool = True) -> None:
        """Closes the store and (``remove``) removes its files."""
        self._store.close(remove)

    def _allocate(self, count: int) -> torch.Tensor:
        reused = min(count, self._free.numel())
        taken = self._free[self._free.numel() - reused:]
        self._free = self._free[:self._free.numel() - reused]
        fresh = count - reused
        if self._used + fresh > self._ids.shape[0]:
            capacity = max(_MIN_CAPACITY, 2 * self._ids.shape[0], self._used + fresh)
            used = self._used

            def grown(old: torch.Tensor) -> torch.Tensor:
                new = torch.empty(capacity, dtype=old.dtype)
                new[:used] = old[:used]
                return new

            self._ids, self._counts, self._last_seen = grown(self._ids), grown(self._counts), grown(self._last_seen)
            self._seen_at, self._layout, self._live = grown(self._seen_at), grown(self._layout), grown(self._live)
            self._changed_in, self._shadow = grown(self._changed_in), grown(self._shadow)
            self._marked = grown(self._marked)
        positions = torch.cat([taken, torch.arange(self._used, self._used + fresh)])
        self._used += fresh
        self._live[positions] = False
        self._shadow[positions] = False
        self._marked[positions] = False
        return positions
