"""A table (or one ps task's shard of it) keyed by any int64 id, with rows made on first touch.

A recommendation model's categorical features are 64-bit hashes, not a dense range, and
new ones keep arriving: a fixed ``nn.Embedding`` would need ``2**64`` rows or a lossy
``id % n``. A :class:`LocalTable` stores only the rows it has been asked for, each
created from its id alone (``initializers``), updated in place by a sparse row
optimizer whose state sits beside it (``row_optimizers``), dropped by an eviction policy
(``eviction``: a time to live in steps or seconds, a frequency filter) and by a row
capacity (``capacity``: least recently or least frequently used first), made only for
ids an admission policy admits (``admission_policies``), and exported or imported so a
checkpoint can be re-split over any number of shards (``shard_of``). Both the one-device
module and each ps task's store hold one per table shard.

Layout: ids map to slots through :class:`~unison._embeddings.tables.id_index.IdIndex`; rows, optimizer
state, touch counts and last-seen steps are growable tensors indexed by slot (capacity
doubles; the unused part is never touched, so it takes no memory), and evicted slots go
to a free list for reuse.

tf.distribute equivalent: none in core TensorFlow; TensorFlow Recommenders-Addons'
``dynamic_embedding.Variable`` is the nearest. Not thread-safe: the holder serialises calls.
"""

from __future__ import annotations

import contextlib
import itertools
import uuid
import warnings
from collections.abc import Callable, Iterator
from typing import Any, final

import numpy as np
import torch

from unison._embeddings.optim.row_optimizers import RowOptimizer, RowState
from unison._embeddings.tables.admission_policies import AdmissionPolicy
from unison._embeddings.tables.bag_layout import BagLayout
from unison._embeddings.tables.capacity import RowCapacity, least_kept, row_capacity
from unison._embeddings.tables.checks import check_table_arguments, checked_ids, checked_meta, dtype_from_name
from unison._embeddings.tables.count_sketch import CountMinSketch
from unison._embeddings.tables.deltas import check_next, checked_delta
from unison._embeddings.tables.distinct_ids import distinct_ids, distinct_ids_and_counts
from unison._embeddings.tables.eviction import EvictionPolicy
from unison._embeddings.tables.id_hashing import shard_of
from unison._embeddings.tables.id_index import IdIndex
from unison._embeddings.tables.initializers import Initializer, initializer_from_config, normal
from unison._embeddings.tables.lower_tier import LowerTier

__all__ = ["LocalTable", "shard_of"]

_MIN_CAPACITY = 16
# the attributes holding a tensor indexed by slot, besides the optimizer state (``_seen_at`` only with a clock)
_SLOT_ATTRIBUTES = ("_rows", "_slot_ids", "_live", "_counts", "_last_seen", "_changed_in", "_seen_at")
_GENERATIONS = itertools.count()  # unique over every table: a reloaded table never repeats one


@final
class LocalTable:
    """One shard of a dynamic embedding table: int64 id -> row of ``embedding_dim`` values.

    Args:
        embedding_dim: columns per row, >= 1.
        dtype: floating dtype of rows and optimizer state.
        initializer: how a missing row is made (default ``normal(0, 1)``, as ``nn.Embedding``).
        seed: mixed into the initializer's hash; shards of one table share it.
        eviction: policy applied by :meth:`evict`; None keeps every row.
        admission: which ids get a row (``AdmitAfter``, ``AdmitWithProbability``); None: every
            id looked up in training. An id without a row reads zeros and takes no update.
        capacity: at most this many rows after :meth:`evict` (rows touched since the last
            step excepted); None: no limit.
        capacity_policy: which rows go first over capacity, ``"lru"`` or ``"lfu"`` (``capacity``).
        lower_tier: the rows of the same table kept below this one (a disk tier's cold rows), or
            None: :meth:`export`, delta checkpoints and serving exports then hold them too, and a
            row moved there (:meth:`take` with ``moving=True``) is not a removal.

    Example:
        >>> from unison._embeddings.optim.row_optimizers import RowSGD
        >>> table = LocalTable(4, seed=1)
        >>> ids = torch.tensor([[2**63 - 1, -7], [-7, 0]])
        >>> table.lookup(ids).shape, table.num_rows
        (torch.Size([2, 2, 4]), 3)
        >>> table.apply_gradients(ids.reshape(-1), torch.ones(4, 4), RowSGD(lr=0.1))
    """

    def __init__(self, embedding_dim: int, *, dtype: torch.dtype = torch.float32,
                 initializer: Initializer | None = None, seed: int = 0,
                 eviction: EvictionPolicy | None = None, admission: AdmissionPolicy | None = None,
                 capacity: int | None = None, capacity_policy: str = "lru",
                 lower_tier: LowerTier | None = None) -> None:
        check_table_arguments("LocalTable", embedding_dim, dtype, initializer, seed, eviction, admission)
        self._capacity: RowCapacity | None = row_capacity("LocalTable", capacity, capacity_policy)
        self._dim, self._dtype, self._seed = embedding_dim, dtype, seed
        self._initializer: Initializer = initializer if initializer is not None else normal(0.0, 1.0)
        self._eviction = eviction
        self._admission = admission
        self._pending = (None if admission is None
                         else CountMinSketch(admission.sketch_width, admission.sketch_depth))
        self._clock = None if eviction is None else eviction.clock
        self._seen_at: torch.Tensor | None = None if self._clock is None else torch.zeros(0, dtype=torch.float64)
        self._warned_over_capacity = False
        self._index = IdIndex()
        self._rows = torch.zeros(0, embedding_dim, dtype=dtype)
        self._slot_ids = torch.zeros(0, dtype=torch.int64)
        self._live = torch.zeros(0, dtype=torch.bool)
        self._counts = torch.zeros(0, dtype=torch.int64)
        self._last_seen = torch.zeros(0, dtype=torch.int64)
        self._state: dict[str, torch.Tensor] = {}
        self._state_init: dict[str, float] = {}
        self._free = torch.zeros(0, dtype=torch.int64)
        self._used = 0  # slots [0, _used) have held a row at some time
        self._num_rows = 0
        self._step = 0
        self._generation = next(_GENERATIONS)
        # the last lookup of distinct ids that made their rows: (those ids, their version counter, their slots, the
        # generation then), so the push of the same ids, unchanged (a module's step), applies to the slots without
        # finding them again
        self._recent: tuple[torch.Tensor, int, torch.Tensor, int] | None = None
        # what changed since a save: a slot's epoch is the save epoch it was last changed in; a save point ends an
        # epoch, so the slots of a delta are those changed after the save's epoch (one write per touch, no scan)
        self._epoch = 1
        self._changed_in = torch.zeros(0, dtype=torch.int64)
        self._removed_log: list[tuple[int, torch.Tensor]] = []  # (epoch, ids removed then)
        self._table_id = uuid.uuid4().hex
        self._sequence = 0  # save points passed
        self._saved_epoch = 0  # the epoch the last save point ended
        self._exact = True  # False: loaded from a full export taken between save points (no delta of its own yet)
        self._export_chain: tuple[str, int, int] | None = None  # serving exports: (export id, number, epoch)
        self._lower = lower_tier

    @property
    def embedding_dim(self) -> int:
        """Columns per row."""
        return self._dim

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of rows and optimizer state."""
        return self._dtype

    @property
    def seed(self) -> int:
        """Seed of the initializer's hash."""
        return self._seed

    @property
    def eviction(self) -> EvictionPolicy | None:
        """The eviction policy, or None."""
        return self._eviction

    @property
    def admission(self) -> AdmissionPolicy | None:
        """The admission policy, or None (every id looked up in training gets a row)."""
        return self._admission

    @property
    def capacity(self) -> RowCapacity | None:
        """The row capacity and its policy, or None."""
        return self._capacity

    @property
    def initializer(self) -> Initializer:
        """How missing rows are made."""
        return self._initializer

    @property
    def current_step(self) -> int:
        """How many times :meth:`step` was called (carried over by export and import): the optimizer
        steps the table has taken, so a row optimizer's step count ``t`` is this plus one."""
        return self._step

    @property
    def num_rows(self) -> int:
        """Rows stored now."""
        return self._num_rows

    @property
    def bytes(self) -> int:
        """Bytes in memory: rows, optimizer state and per-row counters of the slots in use, the
        free list, the id index and the admission sketch (capacity never touched is not
        counted: it takes none)."""
        in_use = sum(t[:self._used].numel() * t.element_size() for t in self._slot_tensors())
        sketch = 0 if self._pending is None else self._pending.nbytes
        return in_use + self._free.numel() * self._free.element_size() + self._index.nbytes + sketch

    def step(self) -> int:
        """Advance the table's clock by one (the unit of ``EvictUnseen``); returns the new step."""
        self._step += 1
        return self._step

    def advance_to(self, step: int) -> int:
        """Moves the clock to ``step`` unless it is past it already (a synchronous job's global step)."""
        self._step = max(self._step, step)
        return self._step

    def lookup(self, ids: torch.Tensor, create: bool = True, occurrences: torch.Tensor | None = None) -> torch.Tensor:
        """Rows of ``ids`` (any shape) as a new ``[*ids.shape, embedding_dim]`` tensor.

        With ``create=True`` missing rows are made and stored, and every id counts as
        touched (its count grows by its occurrences, its last-seen step becomes the
        current step). With ``create=False`` (evaluation) nothing changes: a missing id
        gets the row the initializer would give it, unstored. With an admission policy an
        id is counted and made only when the policy admits it: until then it reads zeros
        (whether ``create`` or not) and is not stored. A caller that already made
        ``ids`` distinct (a module's forward, a ps task's request) passes how often each
        occurred in its batch as ``occurrences``, and the ids are not made distinct again.
        """
        ids = checked_ids(ids, "LocalTable.lookup")
        inverse: torch.Tensor | None = None
        if occurrences is None:
            unique, inverse, occurrences = distinct_ids_and_counts(ids.reshape(-1))
        elif tuple(occurrences.shape) != tuple(ids.shape):
            raise ValueError(f"LocalTable.lookup: `occurrences` must count each of distinct `ids` "
                             f"(shape {tuple(ids.shape)}), got shape {tuple(occurrences.shape)}")
        else:
            unique, occurrences = ids.reshape(-1), occurrences.reshape(-1).to(torch.int64)
        if create:
            rows, slots = self.lookup_distinct(unique, occurrences)
            if inverse is None and self._admission is None:
                self._recent = (ids, ids._version, slots, self._generation)
        else:
            slots = self._index.find(unique)
            rows = torch.empty(unique.numel(), self._dim, dtype=self._dtype)
            present = slots >= 0
            rows[present] = self._rows.index_select(0, slots[present])
            rows[~present] = (0.0 if self._admission is not None  # no row until admitted: zeros
                              else self._initial_rows(unique[~present]))
        if inverse is not None:
            rows = rows.index_select(0, inverse)
        return rows.reshape(*ids.shape, self._dim)

    def apply_gradients(self, ids: torch.Tensor, grads: torch.Tensor, optimizer: RowOptimizer) -> None:
        """Update the rows of ``ids`` in place with ``optimizer`` and their sparse gradients.

        Gradients of an id repeated in ``ids`` are summed first (as a coalesced sparse
        gradient). A missing id (e.g. evicted since it was read) is created first, unless
        the table has an admission policy: then an id without a row takes no update. Rows
        touched get the current step as last seen; their lookup counts do not change.

        Args:
            ids: 1-D integer tensor of ``N`` ids.
            grads: ``[N, embedding_dim]`` floating tensor (cast to the table's dtype).
            optimizer: the row optimizer; its state is allocated on first use.
        """
        ids = checked_ids(ids, "LocalTable.apply_gradients")
        if ids.dim() != 1:
            raise ValueError(f"LocalTable.apply_gradients: `ids` must be 1-D, got shape {tuple(ids.shape)}; "
                             f"fix: pass ids.reshape(-1) and grads.reshape(-1, {self._dim})")
        if not isinstance(grads, torch.Tensor) or not grads.is_floating_point():
            raise TypeError(f"LocalTable.apply_gradients: `grads` must be a floating tensor, got {grads!r:.80}")
        if tuple(grads.shape) != (ids.numel(), self._dim):
            raise ValueError(f"LocalTable.apply_gradients: `grads` must have shape {(ids.numel(), self._dim)} "
                             f"(one row per id), got {tuple(grads.shape)}")
        if not isinstance(optimizer, RowOptimizer):
            raise TypeError(f"LocalTable.apply_gradients: `optimizer` must be a RowOptimizer (e.g. RowSGD(lr)), "
                            f"got {optimizer!r}")
        recent, self._recent = self._recent, None
        if recent is not None and ids is recent[0] and ids._version == recent[1] and recent[3] == self._generation:
            # the distinct ids of the last lookup (a module's forward, then its step), not written since: no
            # summing, and their slots still hold them (no row has left since)
            self.apply_to_slots(recent[2], grads, optimizer)
            return
        unique, inverse = distinct_ids(ids)
        summed = torch.zeros(unique.numel(), self._dim, dtype=self._dtype)
        summed.index_add_(0, inverse, grads.to(self._dtype))
        if self._admission is not None:
            self._fetch_below(unique)
            slots = self._index.find(unique)
        else:
            slots = self._found_or_created(unique)
        self.apply_to_slots(slots, summed, optimizer)

    def lookup_distinct(self, ids: torch.Tensor, occurrences: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``lookup(ids, create=True, occurrences=...)`` for 1-D distinct int64 ``ids``, with their slots.

        The fast path of a ps task: a worker sends each distinct id once, and the slots
        let the push that follows skip finding them again (see :meth:`apply_to_slots`).
        With an admission policy an id without a row after the lookup has slot -1 and a
        zero row.
        """
        occurrences = occurrences.to(torch.int64)
        if self._admission is None:
            slots = self._found_or_created(ids)
            self._counts.index_add_(0, slots, occurrences)
            self._touch(slots)
            return self._rows.index_select(0, slots), slots
        slots = self._found_or_admitted(ids, occurrences)
        have = (slots >= 0).nonzero().squeeze(1)
        stored = slots.index_select(0, have)
        self._counts.index_add_(0, stored, occurrences.index_select(0, have))
        self._touch(stored)
        rows = torch.zeros(ids.numel(), self._dim, dtype=self._dtype)
        rows.index_copy_(0, have, self._rows.index_select(0, stored))
        return rows, slots

    @property
    def generation(self) -> int:
        """Changes whenever a row leaves (eviction, load): slots read before stay valid while it does not."""
        return self._generation

    def apply_to_slots(self, slots: torch.Tensor, grads: torch.Tensor, optimizer: RowOptimizer,
                       at_step: int | None = None) -> None:
        """Updates distinct ``slots`` (of live rows, e.g. from :meth:`lookup_distinct` in the same
        generation) by their summed gradients ``[len(slots), dim]``; slots -1 (ids without a
        row under an admission policy) are left out. ``at_step``: see :meth:`push`."""
        if at_step is not None:
            with self.stepping_at(at_step):
                return self.apply_to_slots(slots, grads, optimizer)
        if self._admission is not None:
            have = (slots >= 0).nonzero().squeeze(1)
            slots, grads = slots.index_select(0, have), grads.index_select(0, have)
        spec = optimizer.state_per_row(self._dim)
        self._ensure_state(spec, f"optimizer {optimizer!r}")
        state = {name: self._state[name].index_select(0, slots) for name in spec}
        # t of the step being applied: this one, not yet counted by the clock (push advances it after)
        rows, state = optimizer.update(self._rows.index_select(0, slots), grads.to(self._dtype), state,
                                       self._step + 1)
        self._rows.index_copy_(0, slots, rows.to(self._dtype))
        for name in spec:
            self._state[name].index_copy_(0, slots, state[name].to(self._dtype))
        self._touch(slots)

    def push(self, ids: torch.Tensor, grads: torch.Tensor, optimizer: RowOptimizer,
             at_step: int | None = None) -> None:
        """One optimizer step: apply the row gradients (if any), advance the clock, evict.

        What an optimizer's ``step()`` does to a table; a ps task does the same to its shard.
        ``at_step``: the push of a synchronous job's global step ``at_step`` (1-based; the
        hybrid strategy's workers each push every step): its rows step as the table's
        ``at_step``-th step (SparseAdam's t, last-seen steps) however many workers pushed it
        before, and the clock moves to ``at_step``, once per global step as on one device.
        """
        if at_step is not None:
            if ids.numel():
                with self.stepping_at(at_step):
                    self.apply_gradients(ids, grads, optimizer)
            self.advance_to(at_step)
            self.evict()
            return
        if ids.numel():
            self.apply_gradients(ids, grads, optimizer)
        self.step()
        self.evict()

    @contextlib.contextmanager
    def stepping_at(self, at_step: int) -> Iterator[None]:
        """Rows applied inside step as the table's ``at_step``-th step (the clock reads ``at_step - 1``
        meanwhile, and is never moved back); :meth:`push` with ``at_step`` uses it."""
        clock, self._step = self._step, at_step - 1
        try:
            yield
        finally:
            self._step = max(clock, at_step - 1)

    def prefers_pooling(self, num_bags: int, num_distinct: int) -> bool:
        """Never: the rows are here, a bag is pooled where it is used."""
        return False

    def pooled_lookup(self, layout: BagLayout, create: bool) -> torch.Tensor:
        """``[num_bags, dim]``: each bag's weighted sum of rows (repeats counted)."""
        return layout.pool(self.lookup(layout.ids, create=create))

    def push_bags(self, bags: tuple[BagLayout, torch.Tensor], optimizer: RowOptimizer) -> None:
        """:meth:`push` with each id's gradient made from its bag's: ``bag_grads[bags] * weights``."""
        layout, bag_grads = bags
        self.push(layout.ids, layout.expand(bag_grads), optimizer)

    def stats(self) -> list[tuple[int, int]]:
        """One place: (rows, bytes)."""
        return [(self.num_rows, self.bytes)]

    def load(self, export: dict[str, Any], *, shard: int | None = None, num_shards: int | None = None) -> None:
        """Replaces every row (and the clock) by an export's (or by shard ``shard`` of ``num_shards`` of it, as
        :meth:`import_`): what ``load_state_dict`` does."""
        fresh = LocalTable(self._dim, dtype=self._dtype, initializer=self._initializer, seed=self._seed,
                           eviction=self._eviction, admission=self._admission,
                           capacity=None if self._capacity is None else self._capacity.rows,
                           capacity_policy="lru" if self._capacity is None else self._capacity.policy)
        fresh.import_(export, shard=shard, num_shards=num_shards)
        fresh.adopt_save_point(export["meta"])
        self.__dict__.update(fresh.__dict__)

    def close(self) -> None:
        """Nothing to release: the rows are in memory (a disk tier closes its files)."""

    # -- seams of a disk tier (``disk.tiered_table``): it applies the policies over every tier itself ------
    @property
    def slot_bytes(self) -> int:
        """Bytes of one row's slot: its values, optimizer state and counters (not the id index)."""
        return sum(t.element_size() * (t.shape[1] if t.dim() == 2 else 1) for t in self._slot_tensors())

    def row_counters(self) -> dict[str, torch.Tensor]:
        """Per stored row (in slot order): ``ids``, ``counts``, ``last_seen`` and, with a clock,
        ``idle_seconds``: what eviction policies and a capacity read."""
        live = self._live_slots()
        out = {"ids": self._slot_ids[live], "counts": self._counts[live], "last_seen": self._last_seen[live]}
        if self._clock is not None and self._seen_at is not None:
            out["idle_seconds"] = self._clock() - self._seen_at[live]
        return out

    def take(self, ids: torch.Tensor, *, moving: bool = False) -> dict[str, Any]:
        """The :meth:`export` of the stored rows among distinct ``ids`` (no admission counts), removed
        from the table: a disk tier evicts them, or (``moving``) moves them to the tier below, and then
        they are no removal for the save points, and ``"changed_in"`` says the save epoch each last
        changed in (give it back with :meth:`restore`)."""
        slots = self._index.find(ids)
        slots = slots[slots >= 0]
        out = self._export_slots(slots, chain=False, changed_in=moving)
        self._remove(slots, log=not moving)
        return out

    def take_coldest(self, count: int, policy: str, protect_from: int) -> dict[str, Any]:
        """:meth:`take` ``(ids, moving=True)`` of up to ``count`` stored rows that ``policy`` keeps least,
        in a capacity's order (:func:`~unison._embeddings.tables.capacity.least_kept`), none last seen
        at step ``protect_from`` or later: what a disk tier spills. Chosen by slot, in numpy over the
        slots' memory (a few ops over every slot, each about a tenth of torch's cost here), so the
        index is probed once, to remove them."""
        used = self._used
        seen, uses = self._last_seen[:used].numpy(), self._counts[:used].numpy()
        candidates = np.flatnonzero(self._live[:used].numpy() & (seen < protect_from))
        count = min(count, candidates.size)
        if count <= 0:
            return self.take(torch.zeros(0, dtype=torch.int64), moving=True)
        slot_ids = self._slot_ids[:used].numpy()[candidates]
        slots = torch.from_numpy(candidates[least_kept(policy, seen[candidates], uses[candidates], slot_ids, count)])
        out = self._export_slots(slots, chain=False, changed_in=True)
        self._remove(slots, log=False)
        return out

    def restore(self, part: dict[str, Any]) -> None:
        """Takes back rows :meth:`take` moved below (``part``: their export with ``"changed_in"``), as
        they were: their values, state, counters and the save epoch they last changed in."""
        slots = self._import_checked(part, torch.arange(part["ids"].numel()))
        self._changed_in.index_copy_(0, slots, part["changed_in"].to(torch.int64))

    @property
    def epoch(self) -> int:
        """The save epoch now: what a row changed now records (``"changed_in"`` of :meth:`take`)."""
        return self._epoch

    def check_import(self, export: dict[str, Any], shard: int | None = None,
                     num_shards: int | None = None) -> torch.Tensor:
        """What :meth:`import_` checks before it changes anything; returns the positions of the export's
        rows this table takes (a disk tier checks first, then places rows in its tiers)."""
        return self._check_import(export, shard, num_shards, "LocalTable.import_")

    def log_removed(self, ids: torch.Tensor) -> None:
        """Records ids removed from the tier below (evicted there) for the save points, as :meth:`evict`
        records its own."""
        if ids.numel() and self._keeps_removed():
            self._removed_log.append((self._epoch, ids.clone()))

    def evict(self) -> torch.Tensor:
        """Remove the rows the eviction policy names, then those over capacity; returns their ids, ascending.

        Without a policy or capacity nothing is removed. Over capacity, rows touched at the
        current step or the one before it (the step :meth:`push` just ended) stay; if
        they alone exceed it, the table stays over capacity until a later call, and warns
        once. A removed row's slot is reused by the next rows created; if its id returns,
        the row starts again from its initial value (under an admission policy: counting
        again from 0).
        """
        removed = [self._remove(self._live_slots()[self._chosen_by_policy()])] if self._eviction is not None else []
        if self._capacity is not None and self._num_rows > self._capacity.rows:
            chosen, over = self._capacity.victims(self._live_slots(), self._slot_ids, self._counts, self._last_seen,
                                                  protect_from=self._step - 1)
            removed.append(self._remove(chosen))
            if over and not self._warned_over_capacity:
                self._warned_over_capacity = True
                warnings.warn(f"LocalTable: {self._num_rows} rows after evicting, over the capacity of "
                              f"{self._capacity.rows}: this step touched {over} more rows than the capacity holds "
                              f"(they go at a later step when untouched; warned once per table); fix: a larger "
                              f"`capacity` or smaller batches", RuntimeWarning, stacklevel=2)
        if not removed:
            return torch.zeros(0, dtype=torch.int64)
        return torch.cat(removed).sort().values

    def _chosen_by_policy(self) -> torch.Tensor:
        """The eviction policy's bool mask over the live slots, checked."""
        assert self._eviction is not None
        live = self._live_slots()
        counters = (self._counts[live], self._last_seen[live], self._step)
        if self._clock is None or self._seen_at is None:
            chosen = self._eviction.select(*counters)
        else:
            chosen = self._eviction.select(*counters, idle_seconds=self._clock() - self._seen_at[live])
        if not isinstance(chosen, torch.Tensor) or chosen.dtype != torch.bool or chosen.shape != live.shape:
            raise TypeError(f"{self._eviction!r}.select must return a bool mask of shape {tuple(live.shape)}, "
                            f"got {chosen!r:.80}")
        return chosen

    def _remove(self, slots: torch.Tensor, log: bool = True) -> torch.Tensor:
        """Drops the rows of live ``slots`` (recorded as removed for the save points when ``log``); returns
        their ids."""
        if slots.numel():
            self._generation = next(_GENERATIONS)
        ids = self._slot_ids[slots]
        if log and ids.numel() and self._keeps_removed():
            self._removed_log.append((self._epoch, ids.clone()))
        self._index.remove(ids)
        self._live[slots] = False
        self._free = torch.cat([self._free, slots])
        self._num_rows -= slots.numel()
        return ids

    def export(self) -> dict[str, Any]:
        """The stored rows, sorted by id, as new tensors (a checkpoint of this shard).

        Returns:
            ``{"ids": [n], "rows": [n, dim], "state": {name: [n, columns]}, "counts": [n],
            "last_seen": [n], "meta": {...}}``; ``meta`` holds the dimension, dtype name,
            seed, step, the initializer's config and each state's initial value. A table
            with a time to live in seconds adds ``"idle_seconds": [n]`` (float64, by its
            clock, now); one with an admission policy ``"pending_counts"``, its sketch's
            ``[depth, width]`` counters of ids without a row. With a ``lower_tier``, its rows too.
        """
        out = self._export_slots(self._live_slots())
        return out if self._lower is None else self._lower.joined(out, None)

    def _export_slots(self, live: torch.Tensor, chain: bool = True, changed_in: bool = False) -> dict[str, Any]:
        """:meth:`export` of the rows in live ``slots`` (any order; sorted by id here); without ``chain``
        (rows a disk tier moves) no admission counts and no save point (which reads every row); with
        ``changed_in`` the save epoch each row last changed in."""
        ids, order = self._slot_ids[live].sort()
        slots = live[order]
        policy_parts: dict[str, torch.Tensor] = {}
        if changed_in:
            policy_parts["changed_in"] = self._changed_in.index_select(0, slots)
        if self._clock is not None and self._seen_at is not None:
            policy_parts["idle_seconds"] = self._clock() - self._seen_at.index_select(0, slots)
        if self._pending is not None and chain:
            policy_parts["pending_counts"] = self._pending.cells()
        return {
            **policy_parts,
            "ids": ids,
            "rows": self._rows.index_select(0, slots),
            "state": {name: values.index_select(0, slots) for name, values in self._state.items()},
            "counts": self._counts.index_select(0, slots),
            "last_seen": self._last_seen.index_select(0, slots),
            "meta": {"embedding_dim": self._dim, "dtype": str(self._dtype), "seed": self._seed,
                     "step": self._step, "initializer": self._initializer.config(),
                     "state_init": dict(self._state_init), **(self._save_point_meta() if chain else {})},
        }

    @classmethod
    def from_export(cls, export: dict[str, Any], *, initializer: Initializer | None = None,
                    eviction: EvictionPolicy | None = None, admission: AdmissionPolicy | None = None,
                    capacity: int | None = None, capacity_policy: str = "lru") -> LocalTable:
        """A table holding exactly an export's rows; the initializer is rebuilt from its
        config unless given (needed for an initializer that is not a built-in). Policies
        are not part of an export: pass them."""
        meta = checked_meta(export)
        table = cls(meta["embedding_dim"], dtype=dtype_from_name(meta["dtype"]),
                    initializer=(initializer if initializer is not None
                                 else initializer_from_config(meta["initializer"])),
                    seed=meta["seed"], eviction=eviction, admission=admission, capacity=capacity,
                    capacity_policy=capacity_policy)
        table.import_(export)
        return table

    def import_(self, export: dict[str, Any], *, shard: int | None = None, num_shards: int | None = None) -> None:
        """Store an export's rows here, replacing any rows with the same ids.

        With ``shard`` and ``num_shards`` only the ids with ``shard_of(ids, num_shards) ==
        shard`` are taken, so importing every old shard's export into new shard ``j`` of
        ``num_shards`` re-splits a table. The step becomes the larger of the two.

        Policy state: a row's idle seconds carry over (a row of an export without them is
        touched now); an admission sketch's counters merge into this table's whole,
        whatever ``shard`` (a count sketch cannot be split by id: each new shard takes
        every old shard's counts, merged by their maximum, so every id keeps its count;
        ``count_sketch``); a table without an admission policy ignores them.
        """
        self._import_checked(export, self._check_import(export, shard, num_shards, "LocalTable.import_"))

    def _check_import(self, export: dict[str, Any], shard: int | None, num_shards: int | None,
                      where: str) -> torch.Tensor:
        """Checks an export fits this table (before anything changes); returns the positions of its rows to take."""
        meta = checked_meta(export)
        for field, mine in (("embedding_dim", self._dim), ("dtype", str(self._dtype)), ("seed", self._seed)):
            if meta[field] != mine:
                raise ValueError(f"{where}: export has {field}={meta[field]!r} but this table has "
                                 f"{mine!r}; fix: import into a table made with the same {field} (or use from_export)")
        if (shard is None) != (num_shards is None):
            raise ValueError(f"{where}: pass both `shard` and `num_shards` or neither, "
                             f"got shard={shard!r}, num_shards={num_shards!r}")
        for name, values in export["state"].items():
            if name in self._state and (self._state[name].shape[1], self._state_init[name]) != (
                    values.shape[1], meta["state_init"][name]):
                raise ValueError(f"{where}: the export's row state {name!r} ({values.shape[1]} columns starting at "
                                 f"{meta['state_init'][name]!r}) differs from this table's; fix: use one "
                                 f"optimizer configuration per table")
        pending = export.get("pending_counts")
        if self._pending is not None and pending is not None and tuple(pending.shape) != (
                self._pending.depth, self._pending.width):
            raise ValueError(f"{where}: the export's admission counts are of a sketch of depth x width "
                             f"{tuple(pending.shape)}, this table's is {(self._pending.depth, self._pending.width)}; "
                             f"fix: build the table with sketch_width={pending.shape[-1]}, "
                             f"sketch_depth={pending.shape[0]} (as the table that saved it)")
        ids = export["ids"]
        if shard is not None and num_shards is not None:
            if isinstance(shard, bool) or not isinstance(shard, int) or not 0 <= shard < num_shards:
                raise ValueError(f"{where}: `shard` must be an int in 0..{num_shards - 1}, got {shard!r}")
            return (shard_of(ids, num_shards) == shard).nonzero().squeeze(1)
        return torch.arange(ids.numel())

    def _import_checked(self, export: dict[str, Any], pick: torch.Tensor) -> torch.Tensor:
        """Stores the rows of ``export`` at ``pick`` (checked by :meth:`_check_import`); returns their slots."""
        meta = export["meta"]
        ids = export["ids"].index_select(0, pick)
        rows = export["rows"].index_select(0, pick)
        self._ensure_state({name: RowState(values.shape[1], meta["state_init"][name])  # refused before any change
                            for name, values in export["state"].items()}, "the export")
        slots = self._index.find(ids)
        missing = slots < 0
        if bool(missing.any()):
            slots[missing] = self._create(ids[missing], rows[missing])
        self._write_rows(slots, export, pick)
        self._changed_in[slots] = self._epoch
        if self._pending is not None and export.get("pending_counts") is not None:
            self._pending.merge(export["pending_counts"], "LocalTable.import_: the export")
        self._step = max(self._step, meta["step"])
        return slots

    def _write_rows(self, slots: torch.Tensor, export: dict[str, Any], pick: torch.Tensor | None) -> None:
        """Writes the rows of ``export`` at ``pick`` (None: all, in order) into live ``slots``: values,
        optimizer state (a state the export lacks starts at its initial value), counts, last-seen steps
        and idle times. The caller has made the export's states (:meth:`_ensure_state`)."""
        def picked(values: torch.Tensor) -> torch.Tensor:
            return values if pick is None else values.index_select(0, pick)

        self._rows.index_copy_(0, slots, picked(export["rows"]))
        for name, values in self._state.items():
            if name in export["state"]:
                values.index_copy_(0, slots, picked(export["state"][name]))
            else:
                values[slots] = self._state_init[name]
        self._counts.index_copy_(0, slots, picked(export["counts"]))
        self._last_seen.index_copy_(0, slots, picked(export["last_seen"]))
        if self._clock is not None and self._seen_at is not None:
            idle = export.get("idle_seconds")
            now = self._clock()  # a row of an export without idle times counts as touched now
            self._seen_at[slots] = now if idle is None else now - picked(idle.to(torch.float64))

    # -- save points: delta checkpoints and serving exports (``deltas``) --------------------------------
    @property
    def save_point(self) -> dict[str, Any]:
        """Where this table's chains stand: ``table_id``, ``sequence`` (save points passed), ``exact``
        (False: loaded from a full export taken between save points, no delta of its own until the next
        one is applied), and the serving exports' ``export_id`` and ``export_number`` (None before the
        first export)."""
        chain = self._export_chain
        return {"table_id": self._table_id, "sequence": self._sequence, "exact": self._exact,
                "export_id": None if chain is None else chain[0], "export_number": None if chain is None else chain[1]}

    def _save_point_meta(self) -> dict[str, Any]:
        """A full export's part of the chain: whether it holds exactly the last save point."""
        exact = self._exact and self._sequence > 0 and not self._changed_since(self._saved_epoch)
        return {"table_id": self._table_id, "sequence": self._sequence, "exact": exact}

    def adopt_save_point(self, meta: dict[str, Any]) -> None:
        """Takes a full export's chain after importing it: its table id and sequence (an export
        without them, from an older unison, starts none), and nothing changed since."""
        if "table_id" in meta and "sequence" in meta:
            self._table_id, self._sequence = str(meta["table_id"]), int(meta["sequence"])
            self._exact = bool(meta.get("exact", False))
        self._end_epoch(checkpoint=True)

    def _changed_since(self, epoch: int) -> bool:
        live = self._live_slots()
        return (bool((self._changed_in.index_select(0, live) > epoch).any())
                or any(e > epoch for e, _ in self._removed_log)
                or (self._lower is not None and self._lower.changed_since(epoch)))

    def _changed_slots(self, epoch: int) -> torch.Tensor:
        """Live slots changed after save epoch ``epoch``."""
        used = self._used
        return ((self._changed_in[:used] > epoch) & self._live[:used]).nonzero().squeeze(1)

    def _removed_since(self, epoch: int) -> torch.Tensor:
        """Distinct ids removed after save epoch ``epoch`` that have no row now, ascending."""
        parts = [ids for e, ids in self._removed_log if e > epoch]
        if not parts:
            return torch.zeros(0, dtype=torch.int64)
        ids = torch.unique(torch.cat(parts))
        gone = self._index.find(ids) < 0
        if self._lower is not None:
            gone &= self._lower.find(ids) < 0
        return ids[gone]

    def _keeps_removed(self) -> bool:
        """Whether removals are logged: only while a chain needs them (a table never saved by delta
        nor exported for serving keeps no log, so its memory does not grow with evictions)."""
        return self._sequence > 0 or self._export_chain is not None

    def _end_epoch(self, *, checkpoint: bool = False, export: bool = False) -> None:
        """A save point for the checkpoint chain and/or the serving chain: what changes from now on is
        in the next delta; removals no chain needs any more are dropped."""
        if checkpoint:
            self._saved_epoch = self._epoch
        if export and self._export_chain is not None:
            self._export_chain = (self._export_chain[0], self._export_chain[1], self._epoch)
        self._epoch += 1
        kept = [self._saved_epoch] if self._sequence > 0 else []
        if self._export_chain is not None:
            kept.append(self._export_chain[2])
        oldest = min(kept, default=self._epoch)
        self._removed_log = [(e, ids) for e, ids in self._removed_log if e > oldest]

    def export_delta(self, full: bool = False, *, expect_sequence: int | None = None) -> dict[str, Any]:
        """A new save point: what changed since the last one (``full=False``), or every row (``full=True``).

        A delta is an :meth:`export` of the rows made, read or updated since the last save
        point, with ``"removed"`` (ids removed since and not back) and ``meta`` naming the
        chain: ``table_id``, ``base`` (the save point it starts from) and ``sequence``
        (``base + 1``). With ``full=True`` it is an :meth:`export` at the new save point
        (``meta["exact"]`` True), which starts a chain. The admission sketch travels whole in
        both. ``expect_sequence`` (a ps task's shard, asked by the table's owner) refuses a
        shard whose sequence differs.

        Raises:
            ValueError: ``full=False`` on a table with no save point yet (the first save of a
                chain is full), or on one loaded from a full export taken between save points
                (its changes before the load are in no delta: apply the next delta, or save full).
        """
        if expect_sequence is not None and expect_sequence != self._sequence:
            raise ValueError(f"LocalTable.export_delta: this shard of table {self._table_id!r} is at save "
                             f"{self._sequence}, the table's owner expected {expect_sequence}; fix: save full "
                             f"(delta_state_dict(full=True)) to start a new chain")
        if not full and self._sequence == 0:
            raise ValueError(f"LocalTable.export_delta: table {self._table_id!r} has no save point yet, so a delta "
                             f"would have no base; fix: make the first save of a chain full "
                             f"(delta_state_dict(full=True)), then deltas")
        if not full and not self._exact:
            raise ValueError(f"LocalTable.export_delta: table {self._table_id!r} was loaded from a full checkpoint "
                             f"taken after save {self._sequence}, so what changed between that save and the full "
                             f"one is in no delta of its own; fix: apply the delta that follows save "
                             f"{self._sequence}, or save full (delta_state_dict(full=True))")
        base = self._sequence
        if full:
            out = self.export()
        else:
            out = self._export_slots(self._changed_slots(self._saved_epoch))
            if self._lower is not None:
                out = self._lower.joined(out, self._saved_epoch)
            out["removed"] = self._removed_since(self._saved_epoch)
        self._sequence, self._exact = base + 1, True
        self._end_epoch(checkpoint=True)
        out["meta"].update(table_id=self._table_id, sequence=self._sequence, exact=True)
        if not full:
            out["meta"]["base"] = base
        return out

    def apply_delta(self, delta: dict[str, Any], *, shard: int | None = None, num_shards: int | None = None,
                    expect: tuple[str, int] | None = None) -> None:
        """Applies a delta of :meth:`export_delta` (of this table's chain, or gathered from its shards).

        The delta's rows replace this table's rows of the same ids (or are made), its removed
        ids go, the admission sketch becomes the delta's, the step the delta's; the table is
        then at the delta's save point. With ``shard``/``num_shards`` only that shard's ids are
        taken (as :meth:`import_`). ``expect`` (a ps task's shard): the table id and sequence
        its owner read, the chain having been checked there.

        Raises:
            ValueError: a delta of another table, out of order or already applied (naming
                both), or one that does not fit this table; nothing is changed.
        """
        meta, pick = self.check_delta(delta, shard=shard, num_shards=num_shards, expect=expect)
        removed = delta["removed"]
        if shard is not None and num_shards is not None:
            removed = removed[shard_of(removed, num_shards) == shard]
        gone = self._index.find(removed)
        self._remove(gone[gone >= 0])
        rows = {key: value for key, value in delta.items() if key not in ("removed", "pending_counts")}
        self._import_checked(rows, pick)
        if self._pending is not None and delta.get("pending_counts") is not None:
            self._pending = CountMinSketch(self._pending.width, self._pending.depth)
            self._pending.merge(delta["pending_counts"], "LocalTable.apply_delta: the delta")
        self._step = int(meta["step"])
        self._table_id, self._sequence, self._exact = str(meta["table_id"]), int(meta["sequence"]), True
        self._end_epoch(checkpoint=True)

    def check_delta(self, delta: dict[str, Any], *, shard: int | None = None, num_shards: int | None = None,
                    expect: tuple[str, int] | None = None) -> tuple[dict[str, Any], torch.Tensor]:
        """What :meth:`apply_delta` checks before it changes anything; returns the delta's meta and the
        positions of its rows this table takes (a disk tier checks first, then moves rows between tiers).

        Raises:
            ValueError: as :meth:`apply_delta`.
        """
        meta = checked_delta(delta, "LocalTable.apply_delta")
        if expect is None:
            check_next("LocalTable.apply_delta", self._table_id, self._sequence, meta["table_id"], meta["base"],
                       meta["sequence"])
        elif expect != (self._table_id, self._sequence) or meta["base"] != self._sequence:
            raise ValueError(f"LocalTable.apply_delta: this shard is table {self._table_id!r} at save "
                             f"{self._sequence}, its owner expected {expect} and the delta starts at save "
                             f"{meta['base']}; nothing was changed. fix: load the full checkpoint, then the deltas")
        return meta, self._check_import(delta, shard, num_shards, "LocalTable.apply_delta")

    def serving_export(self, delta: bool, *, export_id: str | None = None,
                       expect_number: int | None = None) -> dict[str, Any]:
        """Ids and rows for serving (no optimizer state): every row, or what changed since the last export.

        Returns:
            ``{"ids": [n], "rows": [n, dim], "removed": [k], "meta": {"export_id", "number",
            "base", "embedding_dim", "dtype"}}``: a full export starts a chain (``number`` 0,
            ``base`` None; ``export_id`` given by a table's owner for all its shards, else made
            here); a delta export (``delta=True``) holds the rows made, read or updated since the
            previous export and the ids removed since, ``base`` that export's number.

        Raises:
            ValueError: ``delta=True`` with no export before it in this table's life (a job that
                restarted exports full first), or a shard whose chain is not ``expect_number``.
        """
        chain = self._export_chain
        if delta:
            if chain is None:
                raise ValueError("LocalTable.serving_export: a delta export needs an export before it, and this table "
                                 "has made none (a restarted job's first export is full); fix: export with delta=False")
            if expect_number is not None and expect_number != chain[1]:
                raise ValueError(f"LocalTable.serving_export: this shard is at export {chain[1]}, its owner "
                                 f"expected {expect_number}; fix: make a full export")
            slots, removed = self._changed_slots(chain[2]), self._removed_since(chain[2])
            export_id, number, base, after = chain[0], chain[1] + 1, chain[1], chain[2]
        else:
            slots, removed = self._live_slots(), torch.zeros(0, dtype=torch.int64)
            export_id, number, base, after = export_id or uuid.uuid4().hex, 0, None, None
        ids, rows = self._slot_ids[slots], self._rows.index_select(0, slots)
        if self._lower is not None:
            lower_ids, lower_rows = self._lower.serving_rows(after)
            ids, rows = torch.cat([ids, lower_ids]), torch.cat([rows, lower_rows])
        ids, order = ids.sort()
        rows = rows.index_select(0, order)
        self._export_chain = (export_id, number, self._epoch)
        self._end_epoch(export=True)
        return {"ids": ids, "rows": rows, "removed": removed,
                "meta": {"export_id": export_id, "number": number, "base": base, "embedding_dim": self._dim,
                         "dtype": str(self._dtype)}}

    def _live_slots(self) -> torch.Tensor:
        return self._live[:self._used].nonzero().squeeze(1)

    def _initial_rows(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self._initializer(ids, self._dim, self._seed, self._dtype)
        if tuple(rows.shape) != (ids.numel(), self._dim) or rows.dtype != self._dtype:
            raise ValueError(f"initializer {self._initializer!r} returned {tuple(rows.shape)} {rows.dtype} for "
                             f"{ids.numel()} ids; it must return [{ids.numel()}, {self._dim}] {self._dtype}")
        return rows

    def _touch(self, slots: torch.Tensor) -> None:
        """Marks live ``slots`` as used now (the current step, and the clock's time if a policy reads it),
        and changed since the last save."""
        # index_fill_, not ``t[slots] = v``: the indexing path's broadcasting costs half again (6,656 slots: 12 us, 18)
        self._last_seen.index_fill_(0, slots, self._step)
        self._changed_in.index_fill_(0, slots, self._epoch)
        if self._clock is not None and self._seen_at is not None:
            self._seen_at.index_fill_(0, slots, self._clock())

    def _found_or_admitted(self, unique: torch.Tensor, occurrences: torch.Tensor) -> torch.Tensor:
        """Slots of distinct ids, -1 for those without a row after this lookup's admission.

        An id the policy admits gets its row with the count it had before (the sketch's
        estimate, then taken out of the sketch); the others add their occurrences to it.
        """
        assert self._admission is not None and self._pending is not None
        self._fetch_below(unique)
        slots, ends = self._index.find_with_ends(unique)
        missing = (slots < 0).nonzero().squeeze(1)
        if not missing.numel():
            return slots
        new_ids, occurrences = unique.index_select(0, missing), occurrences.index_select(0, missing)
        positions = self._pending.positions(new_ids)  # hashed once for the estimate, the counts and the removal
        seen = self._pending.estimate(new_ids, positions)
        admitted = self._admission.admit(new_ids, seen, occurrences, self._seed)
        if not isinstance(admitted, torch.Tensor) or admitted.dtype != torch.bool or admitted.shape != new_ids.shape:
            raise TypeError(f"{self._admission!r}.admit must return a bool mask of shape {tuple(new_ids.shape)}, "
                            f"got {admitted!r:.80}")
        self._pending.add(new_ids[~admitted], occurrences[~admitted], positions[:, ~admitted])
        if bool(admitted.any()):
            ids, before = new_ids[admitted], seen[admitted]
            self._pending.remove(ids, before, positions[:, admitted])
            made = self._create(ids, self._initial_rows(ids), ends.index_select(0, missing)[admitted])
            self._counts[made] = before
            slots[missing[admitted]] = made
        return slots

    def _found_or_created(self, unique: torch.Tensor) -> torch.Tensor:
        """Slots of distinct ids, the missing ones created (inserted where their probe ended); with a tier
        below, those of them kept there are moved up as they were, in the same insert (one probe of the
        in-memory index for every id, one of the tier below for the ids not in memory)."""
        slots, ends = self._index.find_with_ends(unique)
        missing = (slots < 0).nonzero().squeeze(1)
        if missing.numel():
            new_ids = unique.index_select(0, missing)
            below = self._lower.take_back(new_ids) if self._lower is not None else []
            if below:  # made from their rows below; the initializer only for the ids new to the table
                rows = torch.empty(new_ids.numel(), self._dim, dtype=self._dtype)
                fresh = torch.ones(new_ids.numel(), dtype=torch.bool)
                at = [_positions_in(new_ids, part["ids"]) for part in below]
                for part, where in zip(below, at):
                    rows.index_copy_(0, where, part["rows"])
                    fresh[where] = False
                if bool(fresh.any()):
                    rows[fresh] = self._initial_rows(new_ids[fresh])
            else:
                rows = self._initial_rows(new_ids)
            made = self._create(new_ids, rows, ends.index_select(0, missing))
            for part, where in zip(below, at if below else []):
                self._write_moved(made.index_select(0, where), part)
            slots.index_copy_(0, missing, made)
        return slots

    def _fetch_below(self, unique: torch.Tensor) -> None:
        """Moves the rows of distinct ids kept in the tier below (not in memory) up, as they were: what an
        admission path does before it asks the policy (a row below was admitted long ago)."""
        if self._lower is None:
            return
        absent = unique[self._index.find(unique) < 0]
        if absent.numel():
            for part in self._lower.take_back(absent):
                self._write_moved(self._create(part["ids"], part["rows"]), part)

    def _write_moved(self, slots: torch.Tensor, part: dict[str, Any]) -> None:
        """Writes rows moved up from the tier below (``part``: as :meth:`take` exported them) into ``slots``,
        as they were there, the save epoch each last changed in included."""
        self._ensure_state({name: RowState(values.shape[1], part["meta"]["state_init"][name])
                            for name, values in part["state"].items()}, "the tier below")
        self._write_rows(slots, part, None)
        self._changed_in.index_copy_(0, slots, part["changed_in"].to(torch.int64))

    def _create(self, ids: torch.Tensor, rows: torch.Tensor, hint: torch.Tensor | None = None) -> torch.Tensor:
        """Store distinct absent ids with their rows and fresh counters and state; returns their slots."""
        slots = self._allocate(ids.numel())
        # index_copy_ / index_fill_, not ``t[slots] = v``: the indexing path costs 2-4x per call, and a
        # table that meets new ids makes rows every step
        self._rows.index_copy_(0, slots, rows.to(self._dtype))
        for name, values in self._state.items():
            values.index_fill_(0, slots, self._state_init[name])
        self._counts.index_fill_(0, slots, 0)
        self._touch(slots)
        self._slot_ids.index_copy_(0, slots, ids)
        self._live.index_fill_(0, slots, True)
        self._index.insert(ids, slots, hint)
        self._num_rows += ids.numel()
        return slots

    def _allocate(self, count: int) -> torch.Tensor:
        """``count`` free slots: freed ones first (the most recent first), then never used ones."""
        reused = min(count, self._free.numel())
        taken = self._free[self._free.numel() - reused:].flip(0)
        self._free = self._free[:self._free.numel() - reused]
        fresh = count - reused
        if self._used + fresh > self._rows.shape[0]:
            self._grow(self._used + fresh)
        slots = torch.cat([taken, torch.arange(self._used, self._used + fresh)])
        self._used += fresh
        return slots

    def _grow(self, needed: int) -> None:
        """Reallocate per-slot storage to at least ``needed`` slots, doubling.

        Only slots ``[0, used)`` are copied and ever read (a slot is written whole when a
        row is created in it), so the rest of the capacity is never touched and costs
        address space, not memory: a table's resident size follows its rows, not its
        capacity. Tensors are replaced one at a time, so the copy in flight is one column
        group, not the whole table.
        """
        capacity = max(_MIN_CAPACITY, 2 * self._rows.shape[0], needed)
        used = self._used

        def grown(old: torch.Tensor) -> torch.Tensor:
            new = torch.empty((capacity, *old.shape[1:]), dtype=old.dtype)
            new[:used] = old[:used]
            return new

        self._remake_slot_tensors(grown)

    def compact(self) -> bool:
        """Moves the live rows into the lowest slots and hands the rest of the slot storage back, when
        more than a quarter of the slots used so far are free (a step that made many rows, then
        rows spilled or evicted): a table's resident size follows its rows again, not its high-water
        mark. Slots change (the :attr:`generation` too); returns whether it compacted."""
        count = self._num_rows
        if self._used - count <= max(_MIN_CAPACITY, count // 4):
            return False
        live = self._live_slots()
        capacity = count + max(_MIN_CAPACITY, count // 8)  # room for the next steps' rows before a _grow

        def packed(old: torch.Tensor) -> torch.Tensor:
            new = torch.empty((capacity, *old.shape[1:]), dtype=old.dtype)
            new[:count] = old.index_select(0, live)
            return new

        self._remake_slot_tensors(packed)
        self._used, self._free = count, torch.zeros(0, dtype=torch.int64)
        self._index = IdIndex()
        self._index.insert(self._slot_ids[:count], torch.arange(count))
        self._generation = next(_GENERATIONS)
        return True

    def _slot_tensors(self) -> list[torch.Tensor]:
        """Every tensor indexed by slot: rows, optimizer state, ids and counters (what a slot's bytes are)."""
        kept = (getattr(self, attribute) for attribute in _SLOT_ATTRIBUTES)
        return [t for t in kept if t is not None] + list(self._state.values())

    def _remake_slot_tensors(self, remake: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Replaces every tensor indexed by slot with ``remake(it)``, one at a time (growing, compacting)."""
        for attribute in _SLOT_ATTRIBUTES:
            old = getattr(self, attribute)
            if old is not None:
                setattr(self, attribute, remake(old))
        for name in list(self._state):
            self._state[name] = remake(self._state[name])

    def _ensure_state(self, spec: dict[str, RowState], source: str) -> None:
        """Allocate the state ``spec`` names; refuse one whose shape or start differs from the kept one."""
        for name, wanted in spec.items():
            if name not in self._state:
                state = torch.empty((self._rows.shape[0], wanted.columns), dtype=self._dtype)
                state[:self._used] = wanted.initial  # the slots in use; a new row's state is set when it is made
                self._state[name] = state
                self._state_init[name] = wanted.initial
            elif (self._state[name].shape[1], self._state_init[name]) != (wanted.columns, wanted.initial):
                raise ValueError(f"{source} declares row state {name!r} with {wanted.columns} columns starting at "
                                 f"{wanted.initial!r}, but this table keeps it with {self._state[name].shape[1]} "
                                 f"columns starting at {self._state_init[name]!r}; fix: use one optimizer "
                                 f"configuration per table")


def _positions_in(ids: torch.Tensor, wanted: torch.Tensor) -> torch.Tensor:
    """Where each of ``wanted`` is in the distinct ``ids`` (each of them is there)."""
    order = ids.argsort()
    return order.index_select(0, torch.searchsorted(ids.index_select(0, order), wanted))
