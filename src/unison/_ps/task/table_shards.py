"""The ps side of dynamic embedding tables: one shard of each table, and the requests on it.

A ``DynamicEmbedding`` made under ParameterServerStrategy (or the hybrid strategy) keeps
its rows on the ps tasks: ps task ``k`` holds the rows whose ``shard_of(id, num_ps) ==
k`` in a :class:`~unison._embeddings.tables.local_table.LocalTable`. Workers ask for the rows of
their batch (made on first touch, from the id alone, so which worker asks first never
changes a value) and push summed row gradients with the row optimizer the worker's
``torch.optim`` optimizer maps to; the optimizer state sits beside each row here. Every
push reaches every shard, empty or not, so each shard's clock (the unit of eviction, and
SparseAdam's step count ``t``) advances with the optimizer steps, as the one-device table's does.

Each table has its own lock: requests on different tables, or from different workers,
interleave, and each is applied whole.

A synchronous job (the hybrid strategy: every worker pushes once per global step, naming
it, and says how many workers push) gets one device's update on the global batch: the shard
holds a step's pushes until every worker's has come, and applies their sum once (a row two
workers touched takes one optimizer step with both gradients, not two steps one after the
other, which Adagrad's or Adam's state would tell apart). A lookup that names the steps its
worker pushed waits until the shard applied them, so it reads every worker's update of them.
Its training lookups are gathered the same way: the workers' lookups of a global step are
made as one lookup of their ids together (as one device looks up the global batch), which
costs one call's fixed cost instead of one per worker (``benchmarks/RESULTS.md``).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from unison._embeddings.optim.row_optimizers import RowOptimizer
from unison._embeddings.tables.bag_layout import BagLayout
from unison._embeddings.tables.table import TableConfig

if TYPE_CHECKING:
    from unison._embeddings.tables.disk.tiered_table import TieredTable
    from unison._embeddings.tables.local_table import LocalTable

__all__ = ["TableShards"]

_GATHER_S = 0.05
"""How long a training lookup waits for the other workers' lookups of its global step before it goes
alone. In step they come within a few milliseconds (the dense all-reduce keeps the workers
together); a lookup only one worker makes (a model that looks the table up a varying number of
times) costs this once."""
_GATHER_MISSES_OFF = 3
"""Gathers in a row that time out, after which a shard's lookups go alone for ``_GATHER_PAUSE``
lookups: a job whose workers' lookups do not pair up pays the wait a few times, not every step."""
_GATHER_PAUSE = 1000


class _Union(NamedTuple):
    """The distinct slots of a step's lookups looked up as one, and how many lookups they hold: the
    step's pushes of exactly those lookups sum their gradients by position in it, without a search."""

    slots: torch.Tensor
    lookups: int


class _Push(NamedTuple):
    """One worker's push of a global step, held until every worker's has come."""

    ids: torch.Tensor
    grads: torch.Tensor
    slots: torch.Tensor | None  # the ids' slots from the same session's lookup, in ``generation``
    generation: int
    union: _Union | None = None  # that lookup's union, when it was made with the others of its step...
    where: torch.Tensor | None = None  # ...and the positions of its ids in it


class _Looked(NamedTuple):
    """One lookup's answer: its rows, and their slots in the table's ``generation`` (for its push)."""

    rows: torch.Tensor
    slots: torch.Tensor
    generation: int
    union: _Union | None = None  # made with the other lookups of its step: their union...
    where: torch.Tensor | None = None  # ...and where its ids are in it


class _Gathering:
    """The training lookups of one global step on one shard, until every worker's has come."""

    __slots__ = ("came", "asks", "answers", "failed")

    def __init__(self) -> None:
        self.came = 0  # lookups of the step that came, gathered or gone alone
        self.asks: list[tuple[torch.Tensor, torch.Tensor] | None] = []  # waiting; None: gave up, went alone
        self.answers: list[_Looked] | None = None
        self.failed = False  # the lookup together raised: each looks up alone, for its own error


class _Posted(NamedTuple):
    """A training lookup posted to its shard (:meth:`TableShards.post_rows`), to be taken later."""

    key: str
    ids: torch.Tensor
    occurrences: torch.Tensor
    after_step: int
    wait_s: float
    group: _Gathering | None  # where it waits to be looked up with the others; None: not gathered
    position: int  # its ask's index in ``group.asks``


class _Entry:
    __slots__ = ("config", "place", "table", "lock", "applied", "pending", "failed", "gathering", "gather_misses",
                 "gather_paused")

    def __init__(self, config: TableConfig, place: str):
        self.config, self.place = config, place
        self.table = config.new_table(place)
        self.lock = threading.Lock()
        self.applied = threading.Condition(self.lock)
        """Notified whenever the table's clock moves (a lookup may wait for a global step)."""
        self.pending: dict[int, list[_Push]] = {}
        """Synchronous pushes by global step, not applied yet: some worker's has not come."""
        self.failed: tuple[int, BaseException] | None = None
        """The global step whose summed pushes failed to apply, and why: lookups waiting for it raise."""
        self.gathering: dict[int, _Gathering] = {}
        """Training lookups by the global step they follow, until every worker's has come."""
        self.gather_misses = 0  # gathers in a row that timed out
        self.gather_paused = 0  # lookups left to go alone after ``_GATHER_MISSES_OFF`` misses


class TableShards:
    """The dynamic table shards of one ps task; safe for concurrent sessions.

    ``place`` names this ps task (``"ps-0"``): a table with a disk tier keeps its cold rows
    under ``storage.path / place / <table key>``.
    """

    def __init__(self, place: str = "ps-0") -> None:
        self._place = place
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()
        self._recent = threading.local()  # per session thread: table key -> (ids, slots, generation) of its last lookup

    def _entry(self, key: str) -> _Entry:
        try:
            return self._entries[key]
        except KeyError:
            raise KeyError(f"no dynamic table {key!r} on this ps task; create the DynamicEmbedding in the "
                           f"strategy's scope first") from None

    def create(self, key: str, config: TableConfig) -> None:
        """Makes an empty shard under ``key``; keeps an existing one made with the same config.

        Raises:
            ValueError: if ``key`` exists with another config (two programs disagree).
        """
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self._entries[key] = _Entry(config, f"{self._place}/{_directory_name(key)}")
            elif entry.config.describe() != config.describe():
                raise ValueError(f"dynamic table {key!r} exists on this ps task with {entry.config.describe()}, "
                                 f"asked for {config.describe()}; every worker must build the same model")

    def rows(self, key: str, ids: torch.Tensor, occurrences: torch.Tensor, create: bool, after_step: int = 0,
             wait_s: float = 0.0, lookers: int = 1) -> torch.Tensor:
        """Rows of distinct ``ids`` (made, and counted by ``occurrences``, when ``create``), once the shard
        applied global step ``after_step`` (waiting up to ``wait_s`` for the other workers' pushes of it).

        ``lookers`` > 1 (a synchronous job's training lookup: every one of that many workers looks
        up after the same global step): the workers' lookups of the step are gathered, and the
        shard looks up all of their ids at once. The same rows, counts and optimizer state as one
        after the other (new rows are made from their ids alone), for one call's fixed cost
        instead of one per worker. A lookup waits for the others up to ``_GATHER_S``, then goes
        alone.

        A training lookup remembers the ids' slots for this session: the push that
        follows from the same worker (the same ids, as a rule) skips finding them again.
        """
        entry = self._entry(key)
        with entry.lock:
            self._wait_for_step(entry, key, after_step, wait_s)
            if not create:
                return entry.table.lookup(ids, create=False)
            if lookers > 1:
                looked = _gathered(entry, ids, occurrences, after_step, lookers)
            else:
                looked = _Looked(*entry.table.lookup_distinct(ids, occurrences), entry.table.generation)
            self._recent.__dict__[key] = (ids.clone(), looked)
            return looked.rows

    def post_rows(self, key: str, ids: torch.Tensor, occurrences: torch.Tensor, after_step: int, wait_s: float,
                  lookers: int) -> _Posted:
        """A training lookup of ``lookers`` > 1 (as :meth:`rows`), posted without waiting: the other
        workers' lookups of the step look its ids up with theirs when they come, and
        :meth:`take_rows` hands its rows out later. A worker that serves this ps task in its
        own process posts its lookup here before it waits for the other ps tasks' replies, and
        takes it after them: meanwhile this process's session threads serve the other workers'
        lookups, and with them its own. One it posts last is looked up at once, with theirs.
        """
        entry = self._entry(key)
        with entry.lock:
            if entry.gather_paused > 0:  # counted down by the session threads' lookups
                return _Posted(key, ids, occurrences, after_step, wait_s, None, -1)
            group, position, last = _join(entry, after_step, (ids, occurrences), lookers)
            if last:
                try:
                    self._wait_for_step(entry, key, after_step, wait_s)
                except BaseException:
                    group.failed = True  # the lookups waiting go alone, and meet the same error
                    entry.applied.notify_all()
                    raise
                _look_up_gathered(entry, group)
            return _Posted(key, ids, occurrences, after_step, wait_s, group, position)

    def take_rows(self, posted: _Posted) -> torch.Tensor:
        """The rows of a lookup :meth:`post_rows` posted: from the lookup of the step's lookups together
        where it was made, else looked up alone now (the others' lookups have not come: they go
        alone too, without waiting for it)."""
        entry = self._entry(posted.key)
        with entry.lock:
            group = posted.group
            if group is not None and group.answers is not None:
                looked = group.answers[posted.position]
            else:
                if group is not None:
                    group.asks[posted.position] = None
                self._wait_for_step(entry, posted.key, posted.after_step, posted.wait_s)
                looked = _Looked(*entry.table.lookup_distinct(posted.ids, posted.occurrences), entry.table.generation)
            self._recent.__dict__[posted.key] = (posted.ids.clone(), looked)
            return looked.rows

    def push(self, key: str, ids: torch.Tensor, grads: torch.Tensor, optimizer: RowOptimizer,
             at_step: int | None = None, pushers: int = 1) -> None:
        """Applies row gradients, then advances the shard's clock and evicts (one optimizer step;
        ``at_step``: a synchronous job's global step, ``LocalTable.push``). With ``pushers`` > 1
        (every one of them pushes each global step) the step's pushes are held until all have
        come, then applied once, summed: one device's update on the global batch."""
        entry = self._entry(key)
        recent = self._recent.__dict__.pop(key, None)
        with entry.lock:
            table = entry.table
            push = _Push(ids, grads, None, table.generation)
            if (recent is not None and recent[1].generation == table.generation and recent[0].shape == ids.shape
                    and torch.equal(recent[0], ids)):
                looked = recent[1]  # the ids this session just read
                push = push._replace(slots=looked.slots, union=looked.union, where=looked.where)
            if at_step is None or pushers <= 1 or at_step <= table.current_step:
                # one push a step; or one of a step the clock has passed (workers restarted without a
                # checkpoint count their steps from 0 again): applied on its own, as it comes
                _apply(table, [push], optimizer, at_step)
                entry.applied.notify_all()
                return
            held = entry.pending.setdefault(at_step, [])
            if at_step != table.current_step + 1 or len(held) + 1 < pushers:
                # kept past this request: a session receives the next one into the same buffers
                push = push._replace(ids=ids.clone(), grads=grads.clone())
            held.append(push)
            while len(entry.pending.get(table.current_step + 1, ())) >= pushers:
                step = table.current_step + 1
                try:
                    _apply(table, entry.pending.pop(step), optimizer, step)
                except Exception as e:
                    entry.failed = (step, e)  # every worker's lookup waiting for the step learns why
                    raise
                finally:
                    entry.applied.notify_all()

    def _wait_for_step(self, entry: _Entry, key: str, step: int, wait_s: float) -> None:
        """Waits (holding ``entry.lock``) until the shard applied global ``step``.

        Raises:
            TimeoutError: naming the step and how many workers' pushes of it came, after ``wait_s``.
            RuntimeError: at once, where the sum of an earlier or the same step failed to apply.
        """
        if step <= entry.table.current_step:
            return
        if not entry.applied.wait_for(lambda: step <= entry.table.current_step or _failed_by(entry, step),
                                      timeout=wait_s):
            waiting = entry.table.current_step + 1
            raise TimeoutError(
                f"dynamic table {key!r}: a lookup waited {wait_s:g} s for global step {step} to be applied on this "
                f"ps task, but only step {entry.table.current_step} is: {len(entry.pending.get(waiting, ()))} "
                f"worker(s) pushed step {waiting} so far. Every worker must push once per global step (call "
                f"optimizer.step() on every worker, every step); a worker that stopped ends the job")
        if entry.failed is not None and step > entry.table.current_step:  # woken by a step that failed
            failed, cause = entry.failed
            raise RuntimeError(f"dynamic table {key!r}: the pushes of global step {failed} failed to apply on this "
                               f"ps task ({type(cause).__name__}: {cause}), so global step {step} never will; the "
                               f"worker whose push completed the step raised the error") from cause

    def pool(self, key: str, ids: torch.Tensor, bags: torch.Tensor, weights: torch.Tensor, num_bags: int,
             create: bool, after_step: int = 0, wait_s: float = 0.0) -> torch.Tensor:
        """``[num_bags, dim]``: the weighted sum of the rows of ``ids`` (repeats counted) per bag
        (``after_step``, ``wait_s``: as for :meth:`rows`)."""
        entry = self._entry(key)
        with entry.lock:
            self._wait_for_step(entry, key, after_step, wait_s)
            rows = entry.table.lookup(ids, create=create)
        return BagLayout(ids, bags, weights, num_bags).pool(rows)

    def push_bags(self, key: str, ids: torch.Tensor, bags: torch.Tensor, weights: torch.Tensor,
                  bag_grads: torch.Tensor, optimizer: RowOptimizer, at_step: int | None = None,
                  pushers: int = 1) -> None:
        """:meth:`push` with each id's gradient made here from its bag's: ``bag_grads[bags] * weights``."""
        self.push(key, ids, BagLayout(ids, bags, weights, bag_grads.shape[0]).expand(bag_grads), optimizer, at_step,
                  pushers)

    def export(self, key: str) -> dict[str, Any]:
        """The shard's rows (a checkpoint's part)."""
        entry = self._entry(key)
        with entry.lock:
            return entry.table.export()

    def load(self, key: str, export: dict[str, Any], shard: int, num_shards: int) -> None:
        """Replaces the shard by the rows of ``export`` that belong to shard ``shard`` of ``num_shards`` (a disk
        tier removes its files of the rows before, or resumes from them: ``TieredTable.import_``)."""
        entry = self._entry(key)
        with entry.lock:
            entry.table.load(export, shard=shard, num_shards=num_shards)
            entry.pending.clear()  # pushes of steps before the checkpoint's clock, or of a run that ended
            entry.gathering.clear()  # and lookups (the steps count from the checkpoint's now)
            entry.failed = None
            entry.applied.notify_all()

    def save_point(self, key: str) -> dict[str, Any]:
        """Where the shard's delta and serving chains stand."""
        entry = self._entry(key)
        with entry.lock:
            return entry.table.save_point

    def export_delta(self, key: str, full: bool, sequence: int) -> dict[str, Any]:
        """A new save point of the shard (at save ``sequence``): its delta, or all of it."""
        entry = self._entry(key)
        with entry.lock:
            return entry.table.export_delta(full, expect_sequence=sequence)

    def apply_delta(self, key: str, delta: dict[str, Any], shard: int, num_shards: int,
                    expect: tuple[str, int]) -> None:
        """Applies the rows of a delta that belong to shard ``shard`` of ``num_shards``, whole or not at all."""
        entry = self._entry(key)
        with entry.lock:
            entry.table.apply_delta(delta, shard=shard, num_shards=num_shards, expect=expect)
            entry.pending.clear()
            entry.gathering.clear()
            entry.failed = None
            entry.applied.notify_all()

    def serving_export(self, key: str, delta: bool, export_id: str, number: int) -> dict[str, Any]:
        """The shard's ids and rows for serving: all, or those changed since export ``number``."""
        entry = self._entry(key)
        with entry.lock:
            return entry.table.serving_export(delta, export_id=export_id, expect_number=number if delta else None)

    def stats(self) -> dict[str, tuple[int, int]]:
        """Per table: (rows stored here, bytes allocated for them)."""
        with self._lock:
            entries = dict(self._entries)
        out = {}
        for key, entry in entries.items():
            with entry.lock:
                out[key] = (entry.table.num_rows, entry.table.bytes)
        return out


def _directory_name(key: str) -> str:
    """A table key as one directory name (keys hold ``:``; ``/`` would nest)."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in key)


def _failed_by(entry: _Entry, step: int) -> bool:
    """Whether global ``step`` will never be applied: the sum of an earlier or the same step failed."""
    return entry.failed is not None and entry.failed[0] <= step


def _join(entry: _Entry, step: int, ask: tuple[torch.Tensor, torch.Tensor],
          lookers: int) -> tuple[_Gathering, int, bool]:
    """Adds a lookup after global ``step`` to its gathering (the gatherings of earlier steps dropped:
    their lookups will not all come); the gathering, the ask's index in it, and whether it is the
    last of the ``lookers`` to come (the gathering is then closed: its caller looks them up)."""
    group = entry.gathering.get(step)
    if group is None:
        for old in [s for s in entry.gathering if s < step]:
            del entry.gathering[old]
        group = entry.gathering[step] = _Gathering()
    group.came += 1
    group.asks.append(ask)
    last = group.came >= lookers
    if last:
        del entry.gathering[step]
    return group, len(group.asks) - 1, last


def _look_up_gathered(entry: _Entry, group: _Gathering) -> None:
    """Looks up the asks of a complete gathering together (alone where only one is left), and wakes
    those waiting; on an error each of them looks up alone, to meet its own."""
    entry.gather_misses = 0
    try:
        group.answers = _looked_up_together(entry.table, group.asks)
    except Exception:
        group.failed = True
    finally:
        entry.applied.notify_all()


def _gathered(entry: _Entry, ids: torch.Tensor, occurrences: torch.Tensor, step: int, lookers: int) -> _Looked:
    """This lookup's part of one lookup of the workers' ids after global ``step`` (holding ``entry.lock``).

    The last of the ``lookers`` to come looks up its ids with those of the lookups waiting; the
    others wait for it, and go alone if it does not come within ``_GATHER_S`` (or the lookup
    together fails: each then meets its own error)."""
    table = entry.table
    if entry.gather_paused > 0:
        entry.gather_paused -= 1
        return _Looked(*table.lookup_distinct(ids, occurrences), table.generation)
    group, me, last = _join(entry, step, (ids, occurrences), lookers)
    if last:
        _look_up_gathered(entry, group)
    elif not entry.applied.wait_for(lambda: group.answers is not None or group.failed, timeout=_GATHER_S):
        group.asks[me] = None  # the others' lookups did not come: this one goes alone
        entry.gather_misses += 1
        if entry.gather_misses >= _GATHER_MISSES_OFF:
            entry.gather_misses, entry.gather_paused = 0, _GATHER_PAUSE
    if group.answers is not None:
        return group.answers[me]
    return _Looked(*table.lookup_distinct(ids, occurrences), table.generation)


def _looked_up_together(table: LocalTable | TieredTable,
                        asks: list[tuple[torch.Tensor, torch.Tensor] | None]) -> list[_Looked]:
    """Each ask's rows and slots, from one lookup of all their ids (an id several asked for counted
    with all of their occurrences). The ids are made in sorted order, whichever lookup came first."""
    present = [ask for ask in asks if ask is not None]
    ids, inverse = torch.unique(torch.cat([ask[0] for ask in present]), return_inverse=True)
    occurrences = torch.cat([ask[1].to(torch.int64) for ask in present])
    counts = torch.zeros(ids.numel(), dtype=torch.int64).index_add_(0, inverse, occurrences)
    rows, slots = table.lookup_distinct(ids, counts)
    generation = table.generation
    union = _Union(slots, len(present))
    answers, start = [], 0
    for ask in asks:
        if ask is None:
            answers.append(_Looked(rows[:0], slots[:0], generation))  # went alone: never read
            continue
        where = inverse[start:start + ask[0].numel()]
        start += ask[0].numel()
        answers.append(_Looked(rows.index_select(0, where), slots.index_select(0, where), generation, union, where))
    return answers


def _apply(table: LocalTable | TieredTable, pushes: list[_Push], optimizer: RowOptimizer, at_step: int | None) -> None:
    """One optimizer step of the table with the sum of ``pushes`` (one, or every worker's of a global
    step), then the clock and eviction. Through the slots the lookups found where every push has
    them from the current generation (no second search of the index), else through the ids."""
    found = [p.slots for p in pushes if p.slots is not None and p.generation == table.generation]
    if len(found) == len(pushes):
        union = pushes[0].union
        if len(found) == 1:
            slots, grads = found[0], pushes[0].grads
        elif union is not None and union.lookups == len(pushes) and all(p.union is union for p in pushes):
            # the pushes of exactly the lookups made as one: their gradients summed by position in the
            # lookups' union (each of its slots is some push's), in the order the pushes came
            slots = union.slots
            grads = pushes[0].grads.new_zeros(slots.numel(), pushes[0].grads.shape[1])
            for p in pushes:
                assert p.where is not None  # set with the union
                grads.index_add_(0, p.where, p.grads)
        else:  # a row two workers touched: its gradients summed, in the order the pushes came
            slots, inverse = torch.unique(torch.cat(found), return_inverse=True)
            every = torch.cat([p.grads for p in pushes])
            grads = every.new_zeros(slots.numel(), every.shape[1]).index_add_(0, inverse, every)
        table.apply_to_slots(slots, grads, optimizer, at_step)
        if at_step is None:
            table.step()
        else:
            table.advance_to(at_step)
        table.evict()
        return
    if len(pushes) == 1:
        table.push(pushes[0].ids, pushes[0].grads, optimizer, at_step)
    else:  # the table sums the gradients of an id repeated in ``ids``
        table.push(torch.cat([p.ids for p in pushes]), torch.cat([p.grads for p in pushes]), optimizer, at_step)
