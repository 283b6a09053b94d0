"""The rows of a ``DynamicEmbedding`` that live on ps tasks, as a worker or the chief reaches them.

Row ``id`` lives on ps task ``shard_of(id, num_shards)`` (a hash of the id, so hot and
cold ids spread evenly, negative ids included). A lookup sends each ps task the distinct
ids it owns, one request per ps task, all in flight together; a push sends every ps task
its ids' summed gradients (an empty push too: it advances that shard's clock, so eviction
and SparseAdam's step count ``t`` count optimizer steps on every shard alike). Nothing of the table is kept here between
calls: a worker holds only the rows of its batch.

The connections are handed to it: on the chief (or a hybrid worker), the strategy's
client; a copy pickled into a scheduled function gets the client of the worker that
unpickles it (:mod:`unison._ps.wire.worker_references`). The object pickles to its key and
config only, so a function that captures the module sends no rows.

:class:`RemoteTables` is the ``tables`` component of both parameter-server strategies.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from unison._embeddings.optim.row_optimizers import RowOptimizer
from unison._embeddings.tables.bag_layout import BagLayout
from unison._embeddings.tables.deltas import check_next, checked_delta
from unison._embeddings.tables.distinct_ids import distinct_ids
from unison._embeddings.tables.id_hashing import shard_of
from unison._embeddings.tables.table import TableConfig
from unison._ps.wire import protocol as wire
from unison._ps.wire.client import PSClient
from unison._ps.wire.worker_references import WORKER_CLIENT

__all__ = ["RemoteTable", "RemoteTables"]


class RemoteTable:
    """A table whose shard ``k`` is on ps task ``k`` of ``num_shards``.

    Args:
        key: the table's key on every ps task.
        num_shards: how many ps tasks hold its rows.
        config: what each shard is made from.
        client: where the connections come from. Pickled, a table keeps no client: a worker
            of a ClusterCoordinator that unpickles it hands it its own
            (:mod:`unison._ps.wire.worker_references`).
        grad_scale: a factor for pushed gradients, read at each push (the hybrid strategy's
            ``1 / num_replicas_in_sync`` under the mean reduction); None: 1.
        after_load: called once a checkpoint's rows are on every ps task (the hybrid
            strategy's barrier: no worker trains before every worker has loaded).
        writer: whether this process writes a load (the hybrid strategy: its chief only,
            every worker holding the same checkpoint); None: it does.
        synchronous: every worker pushes once per global step (the hybrid strategy): each
            push names its global step, so a shard steps once per global step however many
            workers push it (SparseAdam's t, last-seen steps), as one device does. Counted
            here, from the step of the last checkpoint loaded. False: each push is a step.
        pushers: synchronous: how many workers push every global step. Each shard sums their
            pushes of a step and applies the sum once (one device's update on the global batch),
            and a lookup waits until the shards applied every step this worker pushed, at most
            ``step_wait_s`` (then ``TimeoutError`` names the step and the pushes that came).
            A training lookup asks every shard, and each shard makes the workers' lookups of a
            step as one (one call's fixed cost instead of one per worker).
    """

    def __init__(self, key: str, num_shards: int, config: TableConfig,
                 client: Callable[[], PSClient], *,
                 grad_scale: Callable[[], float] | None = None, after_load: Callable[[], None] | None = None,
                 writer: Callable[[], bool] | None = None, synchronous: bool = False, pushers: int = 1,
                 step_wait_s: float = 30.0):
        self.key, self.num_shards, self.config = key, num_shards, config
        self._client_source = client
        self._grad_scale = grad_scale
        self._after_load = after_load
        self._writer = writer
        self._synchronous = synchronous
        self._pushers = pushers if synchronous else 1
        self._step_wait_s = step_wait_s
        self._global_step = 0  # synchronous: the global steps pushed so far
        self.traffic = {"rows": 0, "pooled": 0}
        """Lookups made here so far, by kind: distinct rows pulled, or bags pooled on the ps tasks."""
        self._last_split: tuple[torch.Tensor, list[torch.Tensor]] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"key": self.key, "num_shards": self.num_shards, "config": self.config, "_client_source": WORKER_CLIENT,
                "_grad_scale": None, "_after_load": None, "_writer": None, "traffic": {"rows": 0, "pooled": 0},
                "_last_split": None, "_synchronous": False, "_global_step": 0, "_pushers": 1, "_step_wait_s": 30.0}

    @property
    def embedding_dim(self) -> int:
        return self.config.embedding_dim

    def _client(self) -> PSClient:
        return self._client_source()

    def create(self) -> None:
        """Makes the (empty) shards, or checks that existing ones were made with the same config.

        Each shard is made from ``config.per_shard(num_shards)``: a capacity of ``N`` rows is
        ``ceil(N / num_shards)`` rows on each ps task.
        """
        config = self.config.per_shard(self.num_shards)
        self._client().exchange({k: (wire.TableCreate(self.key, config), (), None)
                                 for k in range(self.num_shards)})

    def prefers_pooling(self, num_bags: int, num_distinct: int) -> bool:
        """Whether pooling on the ps tasks moves fewer rows: a partial row per bag and ps task,
        against one row per distinct id."""
        return num_bags * min(self.num_shards, num_distinct) < num_distinct

    def _split(self, ids: torch.Tensor) -> list[torch.Tensor]:
        """Positions in ``ids`` of each shard's ids (a push of the ids just looked up reuses theirs)."""
        last = self._last_split
        if last is not None and last[0].shape == ids.shape and torch.equal(last[0], ids):
            return last[1]
        owner = shard_of(ids, self.num_shards).numpy()
        positions = [torch.from_numpy(np.flatnonzero(owner == k)) for k in range(self.num_shards)]
        self._last_split = (ids, positions)
        return positions

    def lookup(self, ids: torch.Tensor, create: bool = True, occurrences: torch.Tensor | None = None) -> torch.Tensor:
        """Rows of distinct ``ids``, ``[n, dim]``; missing rows are made when ``create``, and
        each id counted by its ``occurrences`` (default once)."""
        if occurrences is None:
            occurrences = torch.ones_like(ids)
        self.traffic["rows"] += 1
        positions = self._split(ids)
        # A synchronous job's training lookup asks every shard, with its ids there or none: each
        # shard gathers every worker's lookup of the step and makes them as one (``TableShards.rows``)
        lookers = self._pushers if create else 1
        asked = {k: where for k, where in enumerate(positions) if where.numel() or lookers > 1}
        # index_select / index_copy_, not advanced indexing: 2-4x less per call on these sizes
        replies = self._client().exchange({k: (wire.TableRows(self.key, create, *self._after_pushes(), lookers),
                                               [ids.index_select(0, where), occurrences.index_select(0, where)],
                                               None) for k, where in asked.items()}, gathered=lookers > 1)
        rows = torch.empty(ids.numel(), self.config.embedding_dim, dtype=self.config.dtype)
        for k, where in asked.items():
            rows.index_copy_(0, where, replies[k][0])
        return rows

    def pooled_lookup(self, layout: BagLayout, create: bool) -> torch.Tensor:
        """``[num_bags, dim]``: each bag's weighted sum of rows, every ps task pooling the rows it holds."""
        requests: dict[int, tuple[Any, Sequence[torch.Tensor], Any]] = {}
        touched_bags: dict[int, torch.Tensor] = {}
        for k, where in enumerate(self._split(layout.ids)):
            if where.numel():
                touched, local = distinct_ids(layout.bags.index_select(0, where))
                touched_bags[k] = touched
                requests[k] = (wire.TablePool(self.key, create, touched.numel(), *self._after_pushes()),
                               [layout.ids.index_select(0, where), local, layout.weights.index_select(0, where)], None)
        self.traffic["pooled"] += 1
        replies = self._client().exchange(requests)
        pooled = torch.zeros(layout.num_bags, self.config.embedding_dim, dtype=self.config.dtype)
        for k, touched in touched_bags.items():
            pooled.index_add_(0, touched, replies[k][0])
        return pooled

    def push_bags(self, bags: tuple[BagLayout, torch.Tensor], optimizer: RowOptimizer) -> None:
        """Like :meth:`push`, with the gradient of each bag: every ps task expands it to its ids."""
        layout, grads = bags
        if self._grad_scale is not None:
            grads = grads * self._grad_scale()
        at_step = self._next_step()
        requests: dict[int, tuple[Any, Sequence[torch.Tensor], Any]] = {}
        for k, where in enumerate(self._split(layout.ids)):
            touched, local = distinct_ids(layout.bags.index_select(0, where))
            requests[k] = (wire.TablePushBags(self.key, optimizer, at_step, self._pushers),
                           [layout.ids.index_select(0, where), local, layout.weights.index_select(0, where),
                            grads.index_select(0, touched)], None)
        self._client().exchange(requests, wait=False)

    def push(self, ids: torch.Tensor, grads: torch.Tensor, optimizer: RowOptimizer) -> None:
        """One optimizer step of the rows: each shard applies its ids' gradients, advances and evicts.

        Sent without waiting, and answered only if it fails: each ps task applies it before
        this worker's next request, so its next lookup sees it (or raises its error);
        ``PSClient.settle`` waits for it (a function's end on a ClusterCoordinator's worker,
        ``HybridParameterServerStrategy.join_pushes``).
        """
        if self._grad_scale is not None:
            grads = grads * self._grad_scale()
        positions = self._split(ids)
        at_step = self._next_step()
        self._client().exchange({k: (wire.TablePush(self.key, optimizer, at_step, self._pushers),
                                     [ids.index_select(0, where), grads.index_select(0, where)], None)
                                 for k, where in enumerate(positions)}, wait=False)

    def _after_pushes(self) -> tuple[int, float]:
        """A lookup's ``after_step`` and ``wait_s``: the shards answer once they applied every global
        step this worker pushed (the other workers' pushes of them too), when they sum a step's pushes."""
        if self._pushers <= 1:
            return 0, 0.0
        return self._global_step, self._step_wait_s

    def _next_step(self) -> int | None:
        """This push's global step (synchronous), else None: the shard counts pushes."""
        if not self._synchronous:
            return None
        self._global_step += 1
        return self._global_step

    def export(self) -> dict[str, Any]:
        """Every shard's rows merged, sorted by id: the export of the whole table."""
        replies = self._client().exchange({k: (wire.TableExport(self.key), (), None) for k in range(self.num_shards)})
        return self._merged([wire.export_from_tensors(replies[k]) for k in range(self.num_shards)])

    def _merged(self, parts: list[dict[str, Any]]) -> dict[str, Any]:
        """Shards' exports (or deltas) as one, sorted by id; the chain's meta is the whole table's."""
        ids = torch.cat([p["ids"] for p in parts])
        ids, order = ids.sort()
        merged: dict[str, Any] = {name: torch.cat([p[name] for p in parts]).index_select(0, order)
                                  for name in ("rows", "counts", "last_seen")}
        state_init = {name: init for p in parts for name, init in p["meta"]["state_init"].items()}
        columns = {name: values.shape[1] for p in parts for name, values in p["state"].items()}
        # a shard that never received a gradient keeps no state yet: its rows start from the initial value
        merged["state"] = {name: torch.cat([p["state"].get(name, torch.full((p["ids"].numel(), columns[name]),
                                                                            state_init[name], dtype=self.config.dtype))
                                            for p in parts]).index_select(0, order)
                           for name in columns}
        merged["ids"] = ids
        merged["meta"] = dict(parts[0]["meta"], step=max(p["meta"]["step"] for p in parts), state_init=state_init)
        if all("idle_seconds" in p for p in parts):
            merged["idle_seconds"] = torch.cat([p["idle_seconds"] for p in parts]).index_select(0, order)
        if all("pending_counts" in p for p in parts):  # admission counts: merged as CountMinSketch.merge does
            merged["pending_counts"] = torch.stack([p["pending_counts"] for p in parts]).amax(0)
        if all("removed" in p for p in parts):
            merged["removed"] = torch.cat([p["removed"] for p in parts]).sort().values
        sequences = {p["meta"].get("sequence") for p in parts}
        merged["meta"]["table_id"] = _whole_id([str(p["meta"].get("table_id")) for p in parts])
        merged["meta"]["exact"] = len(sequences) == 1 and all(p["meta"].get("exact", False) for p in parts)
        merged["meta"]["sequence"] = max(p["meta"].get("sequence", 0) for p in parts)
        disks = {place: sealed for p in parts for place, sealed in p["meta"].get("disk", {}).items()}
        if disks:  # each ps task's sealed disk store (a disk tier's full save), by place
            merged["meta"]["disk"] = disks
        return merged

    def _save_points(self) -> tuple[str, int, list[dict[str, Any]]]:
        """The whole table's id and sequence, and each shard's save point.

        Raises:
            ValueError: if the shards are at different save points (a save was cut short).
        """
        replies = self._client().exchange({k: (wire.TableSavePoint(self.key), (), None)
                                           for k in range(self.num_shards)})
        points = [wire.unpickled(replies[k][0]) for k in range(self.num_shards)]
        sequences = sorted({p["sequence"] for p in points})
        if len(sequences) != 1:
            raise ValueError(f"dynamic table {self.key!r}: its shards are at saves {[p['sequence'] for p in points]} "
                             f"(a save was cut short); fix: load the last full checkpoint, or save full "
                             f"(delta_state_dict(full=True)) to start a new chain")
        return _whole_id([p["table_id"] for p in points]), sequences[0], points

    def export_delta(self, full: bool = False) -> dict[str, Any]:
        """A new save point on every shard, gathered: what changed since the last one, or every row."""
        _, sequence, _ = self._save_points()
        replies = self._client().exchange({k: (wire.TableExportDelta(self.key, bool(full), sequence), (), None)
                                           for k in range(self.num_shards)})
        merged = self._merged([wire.export_from_tensors(replies[k]) for k in range(self.num_shards)])
        merged["meta"]["exact"] = True
        if not full:
            merged["meta"]["base"] = sequence
        return merged

    def apply_delta(self, delta: dict[str, Any]) -> None:
        """Applies a delta (gathered from any number of shards, or one device): each shard takes its ids.

        The chain is checked here against every shard's save point before any shard changes.
        """
        meta = checked_delta(delta, "DynamicEmbedding.load_delta_state_dict")
        self._global_step = max(self._global_step, int(meta.get("step", 0)))  # synchronous pushes go on from there
        if self._writer is None or self._writer():
            table_id, sequence, points = self._save_points()
            check_next(f"dynamic table {self.key!r}", table_id, sequence, meta["table_id"], meta["base"],
                       meta["sequence"])
            tensors = wire.export_tensors(delta)
            self._client().exchange({k: (wire.TableApplyDelta(self.key, k, self.num_shards, points[k]["table_id"],
                                                              sequence), tensors, None)
                                     for k in range(self.num_shards)})
        if self._after_load is not None:
            self._after_load()

    def serving_export(self, delta: bool) -> dict[str, Any]:
        """Every shard's ids and rows for serving, gathered: all of them, or those changed since the last export."""
        _, _, points = self._save_points()
        numbers = {p["export_number"] for p in points}
        export_ids = {p["export_id"] for p in points}
        if delta and (len(numbers) != 1 or len(export_ids) != 1 or None in export_ids):
            raise ValueError(f"dynamic table {self.key!r}: a delta export needs one export before it on every ps "
                             f"task, they stand at {sorted(map(str, numbers))}; fix: export with delta=False")
        export_id = next(iter(export_ids)) if delta else uuid.uuid4().hex
        number = next(iter(numbers)) if delta else 0
        replies = self._client().exchange({k: (wire.TableServingExport(self.key, bool(delta), str(export_id),
                                                                       int(number or 0)), (), None)
                                           for k in range(self.num_shards)})
        metas = [wire.unpickled(replies[k][0]) for k in range(self.num_shards)]
        ids = torch.cat([replies[k][1] for k in range(self.num_shards)])
        ids, order = ids.sort()
        rows = torch.cat([replies[k][2] for k in range(self.num_shards)]).index_select(0, order)
        removed = torch.cat([replies[k][3] for k in range(self.num_shards)]).sort().values
        return {"ids": ids, "rows": rows, "removed": removed, "meta": metas[0]}

    def load(self, export: dict[str, Any]) -> None:
        """Replaces every shard's rows by an export's (from any number of shards, or one device)."""
        self._global_step = int(export.get("meta", {}).get("step", 0))  # synchronous pushes go on from there
        if self._writer is None or self._writer():
            tensors = wire.export_tensors(export)
            self._client().exchange({k: (wire.TableLoad(self.key, k, self.num_shards), tensors, None)
                                     for k in range(self.num_shards)})
        if self._after_load is not None:
            self._after_load()

    def stats(self) -> list[tuple[int, int]]:
        """Per ps task, in order: (rows of this table, bytes they take)."""
        replies = self._client().exchange({k: (wire.TableStats(), (), None) for k in range(self.num_shards)})
        return [wire.unpickled(replies[k][0]).get(self.key, (0, 0)) for k in range(self.num_shards)]

    @property
    def num_rows(self) -> int:
        """Rows stored over all shards."""
        return sum(rows for rows, _ in self.stats())


def _whole_id(shard_ids: list[str]) -> str:
    """A table's id from its shards': theirs when they agree (a table loaded from a checkpoint), else
    all of them in shard order (a table made on the ps tasks, each shard with its own)."""
    return shard_ids[0] if len(set(shard_ids)) == 1 else "+".join(shard_ids)


class RemoteTables:
    """A strategy's ``tables`` component: every table it makes is spread over the ps tasks.

    Keys follow creation order (``{prefix}{n}:dynamic_table``), so every worker running the
    same program names a table alike, and a restarted worker finds the rows it trained.
    The other arguments are handed to each :class:`RemoteTable`.
    """

    def __init__(self, num_shards: int, client: Callable[[], PSClient], *, prefix: str = "",
                 grad_scale: Callable[[], float] | None = None, after_load: Callable[[], None] | None = None,
                 writer: Callable[[], bool] | None = None, synchronous: bool = False, pushers: int = 1,
                 step_wait_s: float = 30.0):
        self._num_shards, self._client, self._prefix = num_shards, client, prefix
        self._grad_scale, self._after_load, self._writer = grad_scale, after_load, writer
        self._synchronous, self._pushers, self._step_wait_s = synchronous, pushers, step_wait_s
        self._ids = itertools.count()

    def create_table(self, config: TableConfig) -> RemoteTable:
        """A table on every ps task, made there now or found there (the same key on every worker)."""
        table = RemoteTable(f"{self._prefix}{next(self._ids)}:dynamic_table", self._num_shards, config, self._client,
                            grad_scale=self._grad_scale, after_load=self._after_load, writer=self._writer,
                            synchronous=self._synchronous, pushers=self._pushers, step_wait_s=self._step_wait_s)
        table.create()
        return table
