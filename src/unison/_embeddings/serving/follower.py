"""``unison.embeddings.ServingFollower``: a serving process follows a training job's serving snapshots.

The other half of :class:`~unison.embeddings.ServingExporter`. :meth:`ServingFollower.poll`
lists the snapshot directory and brings the served model to its newest snapshot: the
deltas after the one it holds, in order, applied in place to its
:class:`~unison.embeddings.ServingEmbedding` tables while lookups go on (each table's
lock); or, when a newer full snapshot exists (a new chain, or a follower that starts
late), that full snapshot loaded into new tables and the deltas after it, swapped in at
once. Everything a poll applies is read and checked first, so a damaged snapshot or a
gap in a chain raises with nothing changed.

A serving process imports this module without any training code (no strategy, no
parameter server, no ``DynamicEmbedding``).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import types
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, final

import torch

from unison._embeddings.serving.serving_embedding import ReadDelta, ServingEmbedding
from unison._embeddings.serving.snapshots import SnapshotMeta, list_snapshots, read_meta, snapshot_path

__all__ = ["ServingFollower", "ServingSnapshot"]


@dataclasses.dataclass(frozen=True)
class ServingSnapshot:
    """One snapshot a :class:`ServingFollower` applied, with the times that give its lag.

    Attributes:
        number: the snapshot's number (its directory's name).
        kind: ``"full"`` or ``"delta"``.
        chain: the number of the full snapshot its chain starts from.
        began: when the trainer began writing it (unix seconds): a row updated before
            this is in it.
        seconds: how long the trainer took to write it.
        applied: when this follower had applied it (unix seconds), lookups answering from it.
        previous_began: when the snapshot before it began (unix seconds), or None if
            that one is gone: an update made just after it began first reaches the
            server in this one.
        info: what the trainer passed to ``export(info=...)``.
    """

    number: int
    kind: str
    chain: int
    began: float
    seconds: float
    applied: float
    previous_began: float | None
    info: dict[str, Any]

    @property
    def lag(self) -> float:
        """Seconds from the export's start to its being served: the lag of a row updated just before it."""
        return self.applied - self.began

    @property
    def worst_lag(self) -> float | None:
        """Seconds from the previous export's start to this one being served: the lag of a row updated
        just after the previous export read it (None if that export is gone)."""
        return None if self.previous_began is None else self.applied - self.previous_began


@final
class ServingFollower:
    """Serves the newest snapshot of a ``ServingExporter``'s directory: tables, dense state, on each ``poll()``.

    Example (the serving process; ``DLRM`` is the training code's model class)::

        follower = unison.embeddings.ServingFollower("snapshots/")
        while True:
            if follower.poll():                             # applies every new snapshot, in order
                model.embeddings = follower.embeddings["table"]   # a new chain brings new tables
                model.load_state_dict(follower.dense_state, strict=False)
            ...                                             # answer requests with model(...)
            time.sleep(1.0)

    Args:
        root: the directory a ``ServingExporter`` writes (it may not exist yet).
        default: the value of every column of an id without a row (``ServingEmbedding``'s).
        clock: wall-clock seconds (unix time, as the exporter's), for ``applied``.

    Thread safety: lookups on ``embeddings[name]`` may run in other threads while
    ``poll`` applies deltas (each table's lock); between two tables, or a table and
    ``dense_state``, a lookup may see one snapshot's and the next's for a moment.

    tf.distribute equivalent: none (TensorFlow Serving polls a directory of model versions
    and loads each whole).
    """

    def __init__(self, root: str | os.PathLike[str], *, default: float = 0.0,
                 clock: Callable[[], float] = time.time) -> None:
        if isinstance(default, bool) or not isinstance(default, (int, float)):
            raise TypeError(f"ServingFollower: `default` must be a number (every column of an unknown id), "
                            f"got {default!r}")
        self.root = Path(root)
        self.default = float(default)
        self._clock = clock
        self._tables: dict[str, ServingEmbedding] = {}
        self._meta: SnapshotMeta | None = None
        self.dense_state: dict[str, torch.Tensor] | None = None
        """The dense layers' state_dict at the snapshot served (None before the first, or without one)."""
        self.last: ServingSnapshot | None = None
        """The snapshot served, with its times; None before the first poll that found one."""
        self._lock = threading.Lock()

    @property
    def embeddings(self) -> Mapping[str, ServingEmbedding]:
        """The served tables by the exporter's names (read it after each poll: a new chain brings new tables)."""
        return types.MappingProxyType(self._tables)

    @property
    def number(self) -> int | None:
        """The number of the snapshot served, or None."""
        return None if self._meta is None else self._meta.number

    def poll(self) -> list[ServingSnapshot]:
        """Applies every snapshot written since the last poll, in order; returns them (empty: none new).

        Where a full snapshot is among the new ones, the newest full one is loaded (into new
        tables) and only the deltas after it are applied: the ones before it are of an
        older chain and are skipped.

        Raises:
            ValueError: a damaged snapshot (its files or ``snapshot.json``), or a chain with
                a gap (a delta whose predecessor is gone, and no full snapshot after it);
                nothing is changed, and a later poll may succeed once the exporter writes a
                full snapshot.
        """
        with self._lock:
            numbers = [n for n in list_snapshots(self.root) if self._meta is None or n > self._meta.number]
            if not numbers:
                return []
            metas = self._metas(numbers)
            if not metas:
                return []
            fulls = [i for i, meta in enumerate(metas) if meta.kind == "full"]
            plan = metas[fulls[-1]:] if fulls else metas
            self._check_plan(plan)
            if plan[0].kind == "full":
                tables = {name: ServingEmbedding.load(self._table_path(plan[0], name), self.default)
                          for name in plan[0].embeddings}
                for meta in plan[1:]:
                    for name, table in tables.items():
                        table.apply_read_delta(table.read_delta(self._table_path(meta, name)))
            else:
                tables = self._tables
                reads = self._read_deltas(plan)
                for step in reads:
                    for name, delta in step.items():
                        tables[name].apply_read_delta(delta)
            newest = plan[-1]
            dense = self._dense_of(newest)
            self._tables, self.dense_state = tables, dense
            applied = self._clock()
            previous = {self._meta.number: self._meta.began} if self._meta is not None else {}
            records = []
            for meta in plan:
                before = previous.get(meta.number - 1, self._began_of(meta.number - 1))
                records.append(ServingSnapshot(meta.number, meta.kind, meta.chain, meta.began, meta.seconds, applied,
                                               before, dict(meta.info)))
                previous[meta.number] = meta.began
            self._meta, self.last = newest, records[-1]
            return records

    def _metas(self, numbers: list[int]) -> list[SnapshotMeta]:
        """The snapshots ``numbers``' metadata, leaving out those the exporter removed since they were listed."""
        metas = []
        for number in numbers:
            try:
                metas.append(read_meta(self.root, number))
            except ValueError:
                if snapshot_path(self.root, number).is_dir():
                    raise
        return metas

    def _check_plan(self, plan: list[SnapshotMeta]) -> None:
        """Every delta follows the snapshot before it in one chain, with the same tables (or raises)."""
        held = self._meta
        for i, meta in enumerate(plan):
            before = plan[i - 1] if i else held
            if meta.kind == "full":
                continue
            if before is None:
                raise ValueError(f"ServingFollower: the oldest snapshot under {str(self.root)!r} is delta "
                                 f"{meta.number} (of chain {meta.chain}) and no full snapshot is there to start "
                                 f"from; nothing was loaded. fix: have the exporter write a full one (full_every, "
                                 f"or export(full=True))")
            if meta.base != before.number or meta.chain != before.chain:
                raise ValueError(f"ServingFollower: snapshot {meta.number} is a delta of chain {meta.chain} after "
                                 f"snapshot {meta.base}, but the follower's next step is after snapshot "
                                 f"{before.number} of chain {before.chain}: a snapshot between is missing; nothing "
                                 f"was changed. fix: wait for the exporter's next full snapshot (full_every)")
            if meta.embeddings != before.embeddings:
                raise ValueError(f"ServingFollower: snapshot {meta.number} holds tables {list(meta.embeddings)}, the "
                                 f"one before it {list(before.embeddings)}; a chain keeps its tables. fix: start "
                                 f"a new chain (a full snapshot) when the model's tables change")

    def _read_deltas(self, plan: list[SnapshotMeta]) -> list[dict[str, ReadDelta]]:
        """Every table's delta of every snapshot in ``plan``, read and checked in order, none applied."""
        at = {name: table.number for name, table in self._tables.items()}
        reads = []
        for meta in plan:
            step = {}
            for name, table in self._tables.items():
                step[name] = table.read_delta(self._table_path(meta, name), after=at[name])
                at[name] = step[name].number
            reads.append(step)
        return reads

    def _table_path(self, meta: SnapshotMeta, name: str) -> Path:
        return snapshot_path(self.root, meta.number) / "embeddings" / name

    def _dense_of(self, meta: SnapshotMeta) -> dict[str, torch.Tensor] | None:
        if meta.dense is None:
            return None
        path = snapshot_path(self.root, meta.number) / meta.dense
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise ValueError(f"ServingFollower: snapshot {meta.number} names dense state {meta.dense!r} but "
                             f"{str(path)!r} is missing; the snapshot is damaged: remove it") from None
        except Exception as error:  # torch raises several types for a damaged or foreign file
            raise ValueError(f"ServingFollower: the dense state {str(path)!r} of snapshot {meta.number} cannot be "
                             f"read ({type(error).__name__}: {error}); the snapshot is damaged: remove it") from error
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise ValueError(f"ServingFollower: {str(path)!r} is not a state_dict of tensors; the snapshot is "
                             f"damaged: remove it")
        return state

    def _began_of(self, number: int) -> float | None:
        """When snapshot ``number`` began, if it is still there and whole."""
        if number < 0:
            return None
        try:
            return read_meta(self.root, number).began
        except ValueError:
            return None

    def __repr__(self) -> str:
        return f"ServingFollower({str(self.root)!r}, tables={list(self._tables)}, snapshot={self.number})"
