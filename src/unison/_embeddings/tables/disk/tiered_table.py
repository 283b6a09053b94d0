"""A table shard whose rows beyond a memory budget live on disk: hot rows in a ``LocalTable``, cold ones in LMDB.

What a ``LocalTable`` does to its rows, this does to the same rows wherever they are, so
a table with ``storage=DiskStorage(...)`` trains, evicts, admits and checkpoints exactly as
it would in memory:

- a lookup or update of a cold row reads it back (values, optimizer state, counters) into
  the hot table, in one batch per request: the hot table asks for the ids it misses
  (``lower_tier.take_back``), so an id in memory costs one probe, as in a table without
  a disk tier;
- after each optimizer step (:meth:`evict`, which a push runs) the eviction policy and the
  capacity choose over every row, hot and cold, from their counters (an evicted cold row
  is deleted from disk), then the hot rows over the budget spill to disk in one batch,
  least recently (``"lru"``) or least often (``"lfu"``) used first; the rows the step
  touched stay in memory (a step that touches more than the budget holds stays over it
  until the next, and warns once);
- an export (a checkpoint) holds both tiers' rows; an import writes the rows beyond the
  budget to disk as it goes, so a shard larger than memory loads in budget-sized chunks;
- delta checkpoints and serving exports are one chain over both tiers, kept by the hot
  table (its table id, sequence, save epochs, removal log): a cold row keeps the save epoch
  it last changed in, so a delta holds the rows changed since the save wherever they sit,
  and a spill or read-back is a move, never a removal (``lower_tier``). A delta applied here
  deletes the cold copies of its rows and of its removed ids, then spills as an import does;
- a full save seals the store and records the cold ids; a table rebuilt on the same path
  resumes from it when it loads that save (``import_``): the checkpoint is the truth, the
  store only spares rewriting the rows it provably still holds as saved.

Spilling is chosen in the push that ends a step, after its rows are applied; the disk
writes are applied in order by the store's writer process (``writer_process``, fed by a thread,
``row_writer``), so they share no GIL with training; the rows in flight are readable. A cold
row read back leaves its disk copy as a shadow (``cold_rows``): the row is in exactly one tier,
memory, and the copy is written over at its next spill.

tf.distribute equivalent: none; DeepRec's multi-tier hash storage (DRAM + SSD, LRU/LFU
caches) and TorchRec's SSD virtual tables do the same for their tables.
"""

from __future__ import annotations

import warnings
from typing import Any, final

import torch

from unison._embeddings.optim.row_optimizers import RowOptimizer
from unison._embeddings.tables.admission_policies import AdmissionPolicy
from unison._embeddings.tables.bag_layout import BagLayout
from unison._embeddings.tables.capacity import RowCapacity
from unison._embeddings.tables.checks import checked_ids
from unison._embeddings.tables.disk.cold_rows import ColdRows
from unison._embeddings.tables.disk.heap import trim_heap
from unison._embeddings.tables.disk.storage import DiskStorage
from unison._embeddings.tables.eviction import EvictionPolicy
from unison._embeddings.tables.id_hashing import shard_of
from unison._embeddings.tables.initializers import Initializer
from unison._embeddings.tables.local_table import LocalTable

__all__ = ["TieredTable"]

_INDEX_BYTES_PER_ROW = 32  # a hot row's id index entry, about
_COLD_BYTES_PER_ROW = 80  # a cold row's counters and index entry, about (``ColdRows``)
_SPILL_SLACK = 16  # a spill goes down to 1/16 below the budget (``TieredTable._spill``)


@final
class TieredTable:
    """One shard of a dynamic table (or a whole one) with its rows beyond ``storage``'s budget on disk.

    Args: as :class:`~unison._embeddings.tables.local_table.LocalTable`'s, and
        storage: the budget, cache policy and directory.
        place: this shard's directory under ``storage.path`` (``"local"``, ``"ps-0/<table>"``).
    """

    def __init__(self, embedding_dim: int, *, storage: DiskStorage, place: str, dtype: torch.dtype = torch.float32,
                 initializer: Initializer | None = None, seed: int = 0, eviction: EvictionPolicy | None = None,
                 admission: AdmissionPolicy | None = None, capacity: RowCapacity | None = None) -> None:
        storage.check_fits("TieredTable", embedding_dim, dtype)
        # the hot table keeps the policies' counters (and the admission sketch); the policies are applied here,
        # over both tiers, so its own evict() is never called
        self._cold = ColdRows(storage.open(place), embedding_dim, dtype, None if eviction is None else eviction.clock)
        self._hot = LocalTable(embedding_dim, dtype=dtype, initializer=initializer, seed=seed, eviction=eviction,
                               admission=admission, lower_tier=_ColdTier(self._cold, embedding_dim, dtype))
        self._storage, self._place = storage, place
        self._eviction, self._capacity = eviction, capacity
        self._warned = {"capacity": False, "budget": False}

    # -- what the Table contract and a ps task's shard ask ------------------------------------------
    @property
    def embedding_dim(self) -> int:
        """Columns per row."""
        return self._hot.embedding_dim

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of rows and optimizer state."""
        return self._hot.dtype

    @property
    def seed(self) -> int:
        """Seed of the initializer's hash."""
        return self._hot.seed

    @property
    def initializer(self) -> Initializer:
        """How missing rows are made."""
        return self._hot.initializer

    @property
    def eviction(self) -> EvictionPolicy | None:
        """The eviction policy, or None."""
        return self._eviction

    @property
    def admission(self) -> AdmissionPolicy | None:
        """The admission policy, or None."""
        return self._hot.admission

    @property
    def capacity(self) -> RowCapacity | None:
        """The row capacity (over both tiers), or None."""
        return self._capacity

    @property
    def storage(self) -> DiskStorage:
        """Where the cold rows are, and the memory budget."""
        return self._storage

    @property
    def current_step(self) -> int:
        """Optimizer steps taken (as ``LocalTable.current_step``)."""
        return self._hot.current_step

    @property
    def num_rows(self) -> int:
        """Rows stored, in memory and on disk."""
        return self._hot.num_rows + self._cold.num_rows

    @property
    def hot_rows(self) -> int:
        """Rows in memory now."""
        return self._hot.num_rows

    @property
    def bytes(self) -> int:
        """Bytes in memory: the hot table's and the cold rows' index and counters (not the store's page cache)."""
        return self._hot.bytes + self._cold.nbytes

    @property
    def rows_read_back(self) -> int:
        """Cold rows read back into memory so far, by lookups and updates (a training request's misses)."""
        return self._cold.rows_lifted

    @property
    def disk_bytes(self) -> int:
        """Bytes of the cold rows' files on disk."""
        return self._cold.disk_bytes

    @property
    def generation(self) -> int:
        """Changes whenever a row leaves memory (spill, eviction, load): slots read before stay valid until then."""
        return self._hot.generation

    def step(self) -> int:
        """Advances the table's clock by one; returns the new step."""
        return self._hot.step()

    def lookup(self, ids: torch.Tensor, create: bool = True, occurrences: torch.Tensor | None = None) -> torch.Tensor:
        """As ``LocalTable.lookup``; cold rows of ``ids`` are read back into memory first (evaluation reads
        them from disk and leaves them there)."""
        ids = checked_ids(ids, "TieredTable.lookup")
        if create:  # the hot table moves the cold rows up as it misses them (``_ColdTier.take_back``)
            return self._hot.lookup(ids, create=True, occurrences=occurrences)
        rows = self._hot.lookup(ids, create=False, occurrences=occurrences)
        wanted = ids.reshape(-1)
        positions = self._cold.find(wanted)
        cold = (positions >= 0).nonzero().squeeze(1)
        if not cold.numel():
            return rows
        parts = self._cold.read(torch.unique(positions.index_select(0, cold)), self._meta())
        found = torch.cat([part["ids"] for part in parts])
        order = found.argsort()
        at = order.index_select(0, torch.searchsorted(found.index_select(0, order), wanted.index_select(0, cold)))
        flat = rows.reshape(-1, self.embedding_dim)
        flat.index_copy_(0, cold, torch.cat([part["rows"] for part in parts]).index_select(0, at))
        return flat.reshape(rows.shape)

    def lookup_distinct(self, ids: torch.Tensor, occurrences: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``LocalTable.lookup_distinct`` (a ps task's lookup), cold rows read back as they are missed."""
        return self._hot.lookup_distinct(ids, occurrences)

    def apply_to_slots(self, slots: torch.Tensor, grads: torch.Tensor, optimizer: RowOptimizer,
                       at_step: int | None = None) -> None:
        """As ``LocalTable.apply_to_slots``: slots of :meth:`lookup_distinct` in the same :attr:`generation`."""
        self._hot.apply_to_slots(slots, grads, optimizer, at_step)

    def advance_to(self, step: int) -> int:
        """As ``LocalTable.advance_to``."""
        return self._hot.advance_to(step)

    def apply_gradients(self, ids: torch.Tensor, grads: torch.Tensor, optimizer: RowOptimizer) -> None:
        """As ``LocalTable.apply_gradients``, cold rows of ``ids`` read back as they are missed."""
        self._hot.apply_gradients(ids, grads, optimizer)

    def push(self, ids: torch.Tensor, grads: torch.Tensor, optimizer: RowOptimizer,
             at_step: int | None = None) -> None:
        """One optimizer step: apply the row gradients (if any), advance the clock, evict, spill
        (``at_step``: as ``LocalTable.push``)."""
        if at_step is not None:
            if ids.numel():
                with self._hot.stepping_at(at_step):
                    self.apply_gradients(ids, grads, optimizer)
            self._hot.advance_to(at_step)
        else:
            if ids.numel():
                self.apply_gradients(ids, grads, optimizer)
            self.step()
        self.evict()

    def prefers_pooling(self, num_bags: int, num_distinct: int) -> bool:
        """Never: the rows are in this process."""
        return False

    def pooled_lookup(self, layout: BagLayout, create: bool) -> torch.Tensor:
        """``[num_bags, dim]``: each bag's weighted sum of rows (repeats counted)."""
        return layout.pool(self.lookup(layout.ids, create=create))

    def push_bags(self, bags: tuple[BagLayout, torch.Tensor], optimizer: RowOptimizer) -> None:
        """:meth:`push` with each id's gradient made from its bag's."""
        layout, bag_grads = bags
        self.push(layout.ids, layout.expand(bag_grads), optimizer)

    def stats(self) -> list[tuple[int, int]]:
        """One place: (rows, bytes in memory)."""
        return [(self.num_rows, self.bytes)]

    def evict(self) -> torch.Tensor:
        """The eviction policy, then the capacity, over both tiers (as ``LocalTable.evict``), then the spill
        of the hot rows over the budget; returns the evicted ids, ascending."""
        removed = self._evict_by_policy() if self._eviction is not None else torch.zeros(0, dtype=torch.int64)
        if self._capacity is not None and self.num_rows > self._capacity.rows:
            removed = torch.cat([removed, self._evict_over_capacity()])
        self._spill()
        return removed.sort().values

    def export(self) -> dict[str, Any]:
        """Every row, in memory and on disk, as ``LocalTable.export`` (sorted by id): a full save, so the store
        is sealed and ``meta["disk"]`` records what a restarted process needs to resume from its files
        (:meth:`import_`)."""
        return self._sealed(self._hot.export())  # the hot table joins the cold rows (``_ColdTier``)

    def import_(self, export: dict[str, Any], *, shard: int | None = None, num_shards: int | None = None) -> None:
        """As ``LocalTable.import_``, in chunks of what the budget holds, the rows beyond it written to disk.

        Resuming: when ``export`` is a full save of this place's rows (``meta["disk"]``) and this
        table is empty, the store the save sealed is reopened if it still holds the save: its seal
        is the save's and the machine has not restarted since it was written. Then the save's cold
        rows that were not written or deleted since stay on disk as they are (no row is rewritten),
        the rows written after the save are deleted, and only the rest (the save's hot rows and the
        ones rolled back) are loaded from ``export``: the checkpoint is the truth. When the store is
        there but cannot be proven to match, every row is loaded from ``export`` and a
        ``RuntimeWarning`` says why.
        """
        pick = self._hot.check_import(export, shard, num_shards)
        pick = self._resumed(export, pick)
        chunk = max(1, self._budget_rows())
        starts = range(0, pick.numel(), chunk) if pick.numel() else range(1)
        for number, start in enumerate(starts):
            part = _selected(export, pick[start:start + chunk], with_sketch=number == 0)
            self._read_back(part["ids"])
            self._hot.import_(part)
            self._spill(protect=False)

    def load(self, export: dict[str, Any], *, shard: int | None = None, num_shards: int | None = None) -> None:
        """Replaces every row (and the clock) by an export's, or by shard ``shard`` of ``num_shards`` of it:
        what ``load_state_dict`` does (the disk files of the rows before are removed, or resumed from when
        the export is this table's own full save: :meth:`import_`)."""
        self._hot.check_import(export, shard, num_shards)
        sealed = export["meta"].get("disk", {}).get(self._place)
        own = sealed is not None and sealed["store"] == self._cold.store.name and self._cold.store.opened
        if own:
            self._cold.close(remove=False)  # the new table reopens this table's files (one handle per process)
        fresh = TieredTable(self.embedding_dim, storage=self._storage, place=self._place, dtype=self.dtype,
                            initializer=self.initializer, seed=self.seed, eviction=self._eviction,
                            admission=self.admission, capacity=self._capacity)
        fresh.import_(export, shard=shard, num_shards=num_shards)
        fresh.adopt_save_point(export["meta"])
        self._cold.close(remove=fresh._cold.store.directory != self._cold.store.directory)
        self.__dict__.update(fresh.__dict__)

    def close(self) -> None:
        """Closes the disk store and removes its files."""
        self._cold.close()

    # -- save points: delta checkpoints and serving exports, one chain over both tiers -------------
    @property
    def save_point(self) -> dict[str, Any]:
        """As ``LocalTable.save_point`` (the hot table keeps the chain)."""
        return self._hot.save_point

    def export_delta(self, full: bool = False, *, expect_sequence: int | None = None) -> dict[str, Any]:
        """As ``LocalTable.export_delta``: the rows changed since the last save point in either tier (the
        cold ones read from disk, left there) and the ids removed from both; a full one seals the store
        as :meth:`export` does."""
        if full:
            return self._sealed(self._hot.export_delta(full, expect_sequence=expect_sequence))
        return self._hot.export_delta(full, expect_sequence=expect_sequence)

    def apply_delta(self, delta: dict[str, Any], *, shard: int | None = None, num_shards: int | None = None,
                    expect: tuple[str, int] | None = None) -> None:
        """As ``LocalTable.apply_delta``, checked before anything changes: the cold copies of the delta's
        rows and of its removed ids are deleted from disk, the hot table applies it, then the rows over
        the budget spill (a delta is the few per cent of rows that changed: it is applied in memory whole)."""
        _, pick = self._hot.check_delta(delta, shard=shard, num_shards=num_shards, expect=expect)
        removed = delta["removed"]
        if shard is not None and num_shards is not None:
            removed = removed[shard_of(removed, num_shards) == shard]
        gone = self._cold.find(removed)
        gone = gone[gone >= 0]
        self._hot.log_removed(self._cold.counters(gone)["ids"])
        self._cold.forget(removed)  # shadow copies of removed rows now in memory
        replaced = self._cold.find(delta["ids"].index_select(0, pick))
        self._cold.remove(torch.unique(torch.cat([gone, replaced[replaced >= 0]])))
        self._hot.apply_delta(delta, shard=shard, num_shards=num_shards, expect=expect)
        self._spill(protect=False)

    def serving_export(self, delta: bool, *, export_id: str | None = None,
                       expect_number: int | None = None) -> dict[str, Any]:
        """As ``LocalTable.serving_export``, over both tiers (cold rows read from disk, left there)."""
        return self._hot.serving_export(delta, export_id=export_id, expect_number=expect_number)

    def adopt_save_point(self, meta: dict[str, Any]) -> None:
        """As ``LocalTable.adopt_save_point``."""
        self._hot.adopt_save_point(meta)

    # -- tiers -------------------------------------------------------------------------------------
    def _meta(self) -> dict[str, Any]:
        return {"embedding_dim": self.embedding_dim, "dtype": str(self.dtype), "seed": self.seed,
                "step": self.current_step, "initializer": self.initializer.config(), "state_init": {}}

    def _sealed(self, export: dict[str, Any]) -> dict[str, Any]:
        """``export`` (a full save) with ``meta["disk"]``: this place's sealed store, its ids on disk."""
        sealed = self._cold.seal()
        if sealed is not None:
            export["meta"]["disk"] = {self._place: sealed}
        return export

    def _resumed(self, export: dict[str, Any], pick: torch.Tensor) -> torch.Tensor:
        """The positions of ``pick`` still to load after keeping what the store of this place's save holds."""
        sealed = export["meta"].get("disk", {}).get(self._place)
        if sealed is None:
            return pick
        rest, why = self._cold.resume(sealed, export, pick, self._hot.epoch)
        if why is not None and (self._storage.path / self._place / str(sealed["store"])).exists():
            warnings.warn(f"DiskStorage: not resuming from the files of the checkpoint's store under "
                          f"{str(self._storage.path / self._place)!r}: {why}; every row of this place is loaded "
                          f"from the checkpoint instead (the same rows, written to disk again)",
                          RuntimeWarning, stacklevel=3)
        return rest

    def _read_back(self, ids: torch.Tensor) -> None:
        """Moves the cold rows among distinct ``ids`` into memory, with their state and counters."""
        if not self._cold.num_rows:
            return
        positions = self._cold.find(ids)
        positions = positions[positions >= 0]
        if not positions.numel():
            return
        for part in self._cold.read(positions, self._meta()):
            self._hot.restore(part)
        self._cold.lift(positions)  # its disk copy stays, a shadow (no write on the read path)

    def _budget_rows(self) -> int:
        """How many rows the budget holds in memory now, beside the cold rows' index, counting the index
        entries that the rows spilled to get there will take."""
        per_row = self._hot.slot_bytes + _INDEX_BYTES_PER_ROW
        free = self._storage.memory_budget_bytes - self._cold.nbytes
        hot = self._hot.num_rows
        if hot * per_row <= free:
            return hot
        if per_row <= _COLD_BYTES_PER_ROW:  # a spilled row saves nothing: keep what fits now
            return max(0, free // per_row)
        return max(0, (free - hot * _COLD_BYTES_PER_ROW) // (per_row - _COLD_BYTES_PER_ROW))

    def _spill(self, protect: bool = True) -> None:
        """Writes the hot rows over the budget to disk, in batches (``storage.cache`` chooses which).

        Once over the budget, the rows spill down to ``1 / _SPILL_SLACK`` below it: the choice of
        victims reads every hot row's counters, so it runs every few steps (the rows a step reads
        back fill the slack), not at each, and each batch of writes is larger. The cold rows'
        index grows with each batch and counts against the budget, so the budget is read again
        after each (a few rounds: each takes the rows its index costs).
        """
        protect_from = self.current_step - 1 if protect else 2 ** 62
        over = 0
        for _ in range(4):
            allowed = self._budget_rows()
            if self._hot.num_rows <= allowed:
                return
            wanted = self._hot.num_rows - (allowed - allowed // _SPILL_SLACK)
            moved = self._hot.take_coldest(wanted, self._storage.cache, protect_from)
            over = max(0, self._hot.num_rows - allowed)  # rows over the budget itself
            if not moved["ids"].numel():
                break
            self._cold.put(moved)
            if self._hot.compact():  # after a step over the budget (a fill, a large batch): its slots go back
                trim_heap()
        if over and not self._warned["budget"]:
            self._warned["budget"] = True
            warnings.warn(f"DiskStorage: {self._hot.num_rows} rows in memory after spilling, over the "
                          f"{allowed} that memory_budget_bytes={self._storage.memory_budget_bytes} holds: this step "
                          f"touched {over} more rows than the budget holds (they spill at a later step; warned "
                          f"once per table); fix: a larger `memory_budget_bytes` or smaller batches",
                          RuntimeWarning, stacklevel=3)

    def _counters(self) -> tuple[dict[str, torch.Tensor], torch.Tensor, int]:
        """Both tiers' counters, concatenated (hot rows first), the cold positions, and the hot count."""
        hot = self._hot.row_counters()
        positions = self._cold.live_positions()
        cold = self._cold.counters(positions)
        return {key: torch.cat([hot[key], cold[key]]) for key in hot}, positions, hot["ids"].numel()

    def _remove(self, chosen: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor, num_hot: int) -> torch.Tensor:
        """Deletes the rows at ``chosen`` (indices into :meth:`_counters`) from their tier; returns their ids."""
        in_hot = chosen[chosen < num_hot]
        self._hot.take(ids.index_select(0, in_hot))
        self._cold.forget(ids.index_select(0, in_hot))  # their shadow copies on disk
        in_cold = chosen[chosen >= num_hot]
        self._hot.log_removed(ids.index_select(0, in_cold))  # the chain's removals, wherever the row was
        self._cold.remove(positions.index_select(0, in_cold - num_hot))
        return ids.index_select(0, chosen)

    def _evict_by_policy(self) -> torch.Tensor:
        assert self._eviction is not None
        counters, positions, num_hot = self._counters()
        args = (counters["counts"], counters["last_seen"], self.current_step)
        if "idle_seconds" in counters:
            chosen = self._eviction.select(*args, idle_seconds=counters["idle_seconds"])
        else:
            chosen = self._eviction.select(*args)
        if not isinstance(chosen, torch.Tensor) or chosen.dtype != torch.bool or chosen.shape != counters["ids"].shape:
            raise TypeError(f"{self._eviction!r}.select must return a bool mask of shape "
                            f"{tuple(counters['ids'].shape)}, got {chosen!r:.80}")
        return self._remove(chosen.nonzero().squeeze(1), counters["ids"], positions, num_hot)

    def _evict_over_capacity(self) -> torch.Tensor:
        assert self._capacity is not None
        counters, positions, num_hot = self._counters()
        live = torch.arange(counters["ids"].numel())
        chosen, over = self._capacity.victims(live, counters["ids"], counters["counts"], counters["last_seen"],
                                              protect_from=self.current_step - 1)
        removed = self._remove(chosen, counters["ids"], positions, num_hot)
        if over and not self._warned["capacity"]:
            self._warned["capacity"] = True
            warnings.warn(f"TieredTable: {self.num_rows} rows after evicting, over the capacity of "
                          f"{self._capacity.rows}: this step touched {over} more rows than the capacity holds "
                          f"(they go at a later step when untouched; warned once per table); fix: a larger "
                          f"`capacity` or smaller batches", RuntimeWarning, stacklevel=3)
        return removed


def _selected(export: dict[str, Any], pick: torch.Tensor, with_sketch: bool) -> dict[str, Any]:
    """The rows of ``export`` at ``pick``, as an export (the admission sketch only ``with_sketch``)."""
    out: dict[str, Any] = {key: export[key].index_select(0, pick)
                           for key in ("ids", "rows", "counts", "last_seen", "idle_seconds") if key in export}
    out["state"] = {name: values.index_select(0, pick) for name, values in export["state"].items()}
    out["meta"] = export["meta"]
    if with_sketch and export.get("pending_counts") is not None:
        out["pending_counts"] = export["pending_counts"]
    return out


@final
class _ColdTier:
    """The cold rows as the hot table's ``LowerTier``: what its exports and save points read of them."""

    def __init__(self, cold: ColdRows, embedding_dim: int, dtype: torch.dtype) -> None:
        self._cold, self._dim, self._dtype = cold, embedding_dim, dtype

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        return self._cold.find(ids)

    def take_back(self, ids: torch.Tensor) -> list[dict[str, Any]]:
        positions = self._cold.find(ids)
        positions = positions[positions >= 0]
        if not positions.numel():
            return []
        parts = self._cold.read(positions, {})
        self._cold.lift(positions)  # its disk copy stays, a shadow (no write on the read path)
        return parts

    def _positions(self, changed_after: int | None) -> torch.Tensor:
        return self._cold.live_positions() if changed_after is None else self._cold.changed_positions(changed_after)

    def joined(self, export: dict[str, Any], changed_after: int | None) -> dict[str, Any]:
        positions = self._positions(changed_after)
        if not positions.numel():
            return export
        return _joined([export, *self._cold.read(positions, export["meta"])], export["meta"], self._dtype)

    def changed_since(self, epoch: int) -> bool:
        return bool(self._cold.changed_positions(epoch).numel())

    def serving_rows(self, changed_after: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        parts = self._cold.read(self._positions(changed_after), {})
        if not parts:
            return torch.zeros(0, dtype=torch.int64), torch.zeros(0, self._dim, dtype=self._dtype)
        return torch.cat([part["ids"] for part in parts]), torch.cat([part["rows"] for part in parts])


def _joined(parts: list[dict[str, Any]], meta: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """One export of disjoint parts (sorted by id); a state a part lacks starts at its initial value."""
    state_init = dict(meta["state_init"])
    for part in parts:
        state_init.update(part["meta"]["state_init"])
    ids = torch.cat([part["ids"] for part in parts])
    order = ids.argsort()
    out: dict[str, Any] = {"ids": ids.index_select(0, order)}
    for key in ("rows", "counts", "last_seen", "idle_seconds"):
        if key in parts[0]:
            out[key] = torch.cat([part[key] for part in parts]).index_select(0, order)
    columns = {name: values.shape[1] for part in parts for name, values in part["state"].items()}
    out["state"] = {name: torch.cat([part["state"].get(name, torch.full((part["ids"].numel(), width),
                                                                         state_init[name], dtype=dtype))
                                     for part in parts]).index_select(0, order)
                    for name, width in columns.items()}
    if parts[0].get("pending_counts") is not None:
        out["pending_counts"] = parts[0]["pending_counts"]
    out["meta"] = {**meta, "state_init": state_init}
    return out
