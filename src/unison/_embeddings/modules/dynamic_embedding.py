"""``unison.DynamicEmbedding``: an embedding keyed by any int64 id, rows made on first touch.

Recommendation models look up 64-bit feature hashes (user ids, item ids, crossed
features), not a dense range known in advance; a fixed ``nn.Embedding`` forces them into
``id % n`` and collisions. This module trains a :class:`~unison._embeddings.tables.table.Table`:
a forward pass creates the rows of ids it has not seen (each from the table's
initializer and the id alone, so the order rows are made in never changes their values),
and the optimizer that holds the module's ``weight`` handle updates exactly the rows the
batch touched, with their optimizer state kept next to each row.

How rows train. Rows are not parameters a ``torch.optim`` optimizer can hold (they come
and go). The module registers one empty parameter, ``weight``, as a handle; backward
records each batch's row gradients (summed per id, across backward passes until the
step, as gradients accumulate), and the ``step()`` of an optimizer whose param groups
hold the handle applies them with that group's hyper-parameters (a process-wide
optimizer step pre-hook, installed with the first module: ``row_updates.py``). ``SGD`` (plain: no momentum,
weight decay, or maximize), ``Adagrad`` (no ``lr_decay``/weight decay), ``SparseAdam`` and
``unison.optim.Ftrl`` map to the row updates ``RowSGD``, ``RowAdagrad``, ``RowSparseAdam``
and ``RowFtrl``, which equal theirs on a sparse gradient (``nn.Embedding(sparse=True)``;
Ftrl: TensorFlow's sparse FTRL): only the rows a batch touched move. ``Adam``/``AdamW`` are
refused naming ``SparseAdam`` (their dense step would move untouched rows), others with
the fix. Other parameters of the same optimizer step as usual.

SparseAdam's bias correction needs the step count ``t`` it keeps per parameter: here the
table keeps it, as its clock (one per optimizer step, the rows touched or not; a row made
at step ``t`` starts with zero moments there) and checkpoints it in ``_extra_state``. On
ps tasks every push advances every shard's ``t``, so one function at a time trains as
one device; under the hybrid strategy each push names its global step, and ``t`` is that
step, as on one device on the global batch.

Table policies (the same on one device, on ps tasks and under the hybrid strategy):
``admission`` gives a row only to ids a policy admits (``AdmitAfter(count)``,
``AdmitWithProbability(p)``; until then an id reads zeros and takes no update),
``capacity`` keeps at most that many rows after each optimizer step (``capacity_policy``
``"lru"`` or ``"lfu"``), and ``eviction`` drops rows by a time to live in steps or seconds
(``EvictUnseen(steps, seconds=...)``) or a frequency filter; admission and capacity
combine with eviction.

Checkpoints: ``state_dict()`` holds the rows that exist (ids, rows, their optimizer
state, touch counts), the table's step count, the admission sketch's counts of ids
without a row and, with a time to live in seconds, each row's idle seconds;
``load_state_dict`` restores them. ``delta_state_dict()`` holds only what changed since
the table's previous save point (rows made, read or updated, and the ids removed since)
and ``load_delta_state_dict`` applies it; ``delta_state_dict(full=True)`` is a full one
that starts a chain (``unison._embeddings.tables.deltas`` has the rules: each table has
an id, each delta a sequence number, and a delta of another table, out of order or
applied twice is refused). ``unison.embeddings.export_for_serving`` writes ids and rows
only, for a :class:`~unison.embeddings.ServingEmbedding`.

Where the rows live is the strategy's choice (its ``tables`` component; the module tests
no types): on one device (no strategy, ``OneDeviceStrategy``) in this
process (:class:`~unison._embeddings.tables.local_table.LocalTable`); made in a
``ParameterServerStrategy``'s or ``HybridParameterServerStrategy``'s
scope, on the cluster's ps tasks (:class:`~unison._ps.worker.remote_table.RemoteTable`: row ``id``
on ps task ``shard_of(id, M)``), so a worker holds only the rows of its batch and the
same model code runs in all three. With a bag ``mode``, where it saves bytes, each ps
task pools its rows of a bag and a bag's gradient is pushed whole. Other strategies
refuse it with the fix.

tf.distribute equivalent: none in core TensorFlow; TensorFlow Recommenders-Addons'
``dynamic_embedding.get_variable`` with ``embedding_lookup``, and TorchRec's
``EmbeddingBagCollection`` with ``mode`` bags.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from unison._checkpoint.table_saves import tables_left_out
from unison._embeddings.modules.row_updates import install_row_updates, register_table_module
from unison._embeddings.optim.row_optimizers import RowOptimizer
from unison._embeddings.tables.admission_policies import AdmissionPolicy
from unison._embeddings.tables.bag_layout import BagLayout, bag_layout
from unison._embeddings.tables.capacity import row_capacity
from unison._embeddings.tables.checks import POLICY_KEYS, check_table_arguments
from unison._embeddings.tables.disk.storage import DiskStorage
from unison._embeddings.tables.distinct_ids import distinct_ids_and_counts
from unison._embeddings.tables.eviction import EvictionPolicy
from unison._embeddings.tables.initializers import Initializer, normal
from unison._embeddings.tables.table import Table, TableConfig, TableFactory
from unison._interpose.eager_under_compile import eager_under_compile
from unison._strategies.current import get_strategy

__all__ = ["DynamicEmbedding"]

_MODES = (None, "sum", "mean")
_TABLE_KEYS = ("ids", "rows", "counts", "last_seen")

class DynamicEmbedding(nn.Module):
    """Embedding rows for any int64 ids, created on first touch; optionally pooled into bags.

    Args:
        embedding_dim: columns per row, >= 1.
        initializer: how a missing row is made (``unison._embeddings.tables.initializers``: ``normal``,
            ``uniform``, ``zeros``); default ``normal(0, 1)``, as ``nn.Embedding``.
        mode: None (one row per id, output ``[*ids.shape, dim]``), or ``"sum"``/``"mean"``:
            each bag of ids pooled to one row, as ``nn.EmbeddingBag`` (a 2-D ``ids`` of
            equal bags, or 1-D ``ids`` with ``offsets``; ``per_sample_weights`` with "sum").
        eviction: a policy (``EvictUnseen(steps, seconds=...)``: a time to live in optimizer
            steps and/or seconds; ``EvictBelowCount(count)``) applied after every optimizer
            step; None keeps every row.
        admission: which ids get a row (``unison.embeddings.AdmitAfter(count)``: once seen
            ``count`` times in training lookups; ``AdmitWithProbability(p)``); None: every id
            looked up in training. An id without a row reads zeros (in training and
            evaluation) and takes no update; the batch that admits it makes its row and
            trains it.
        capacity: at most this many rows after every optimizer step (on ``M`` ps tasks
            ``ceil(capacity / M)`` per task); rows the step touched stay. None: no limit.
        capacity_policy: over capacity, ``"lru"`` evicts the least recently used rows first
            (ties: lower count, then smaller id), ``"lfu"`` the lowest counts first.
        seed: mixed into every row's initial values.
        dtype: the rows' floating dtype.
        num_embeddings: None (any int64 id), or ``n``: ids must lie in ``[0, n)`` and an id
            outside raises ``IndexError``, as in the ``nn.Embedding`` the module replaces
            (``unison.embeddings.on_ps``).
        row_wise_adagrad: trained by ``torch.optim.Adagrad``, keep one accumulator per row
            (``RowWiseAdagrad``, TorchRec's ``EXACT_ROWWISE_ADAGRAD``) instead of one per
            value: ``1/embedding_dim`` of the state memory, a step size per row.
        storage: None (every row in memory), or ``unison.embeddings.DiskStorage(path,
            memory_budget_bytes=...)``: each place that owns rows (this process, or each ps
            task for its shard) keeps that many bytes of hot rows in memory and the rest on
            local disk; the rows train, evict, checkpoint (full and delta) and export for
            serving as they would in memory.

    Example:
        >>> emb = DynamicEmbedding(4, mode="sum")
        >>> opt = torch.optim.Adagrad(emb.parameters(), lr=0.1)
        >>> out = emb(torch.tensor([[2**62, -5], [-5, 7]]))
        >>> out.shape, emb.num_rows
        (torch.Size([2, 4]), 3)
        >>> out.sum().backward(); opt.step()
    """

    def __init__(self, embedding_dim: int, *, initializer: Initializer | None = None, mode: str | None = None,
                 eviction: EvictionPolicy | None = None, seed: int = 0, dtype: torch.dtype = torch.float32,
                 row_wise_adagrad: bool = False, num_embeddings: int | None = None,
                 admission: AdmissionPolicy | None = None, capacity: int | None = None,
                 capacity_policy: str = "lru", storage: DiskStorage | None = None):
        super().__init__()
        if mode not in _MODES:
            raise ValueError(f"DynamicEmbedding: `mode` must be None, 'sum' or 'mean', got {mode!r}")
        check_table_arguments("DynamicEmbedding", embedding_dim, dtype, initializer, seed, eviction, admission)
        if num_embeddings is not None and (isinstance(num_embeddings, bool) or not isinstance(num_embeddings, int)
                                           or num_embeddings < 1):
            raise ValueError(f"DynamicEmbedding: `num_embeddings` must be None or an int >= 1, got {num_embeddings!r}")
        if storage is not None:
            if not isinstance(storage, DiskStorage):
                raise TypeError(f"DynamicEmbedding: `storage` must be None (rows in memory) or a "
                                f"unison.embeddings.DiskStorage(path, memory_budget_bytes=...), got {storage!r:.80}")
            storage.check_fits("DynamicEmbedding", embedding_dim, dtype)
        config = TableConfig(
            embedding_dim, dtype, initializer if initializer is not None else normal(0.0, 1.0), seed, eviction,
            admission, row_capacity("DynamicEmbedding", capacity, capacity_policy), storage,
        )
        self.table: Table = _tables_of_scope().create_table(config)
        """The rows (:class:`~unison._embeddings.tables.table.Table`): in this process, or on the ps tasks of
        the strategy in whose scope the module was built (its ``tables`` component decides)."""
        self.mode = mode
        self.row_wise_adagrad = bool(row_wise_adagrad)
        self.num_embeddings = num_embeddings
        self.weight = nn.Parameter(torch.zeros(0, embedding_dim, dtype=dtype))
        """A handle, no values: an optimizer that holds it updates the rows the last backward passes touched."""
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._pending_bags: list[tuple[BagLayout, torch.Tensor]] = []
        register_table_module(self)
        install_row_updates()

    @property
    def embedding_dim(self) -> int:
        """Columns per row."""
        return self.table.embedding_dim

    @property
    def num_rows(self) -> int:
        """How many rows exist."""
        return self.table.num_rows

    @eager_under_compile
    def forward(self, ids: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        """Rows of ``ids`` (or, with ``mode``, one pooled row per bag); missing rows are made when training.

        Under ``torch.compile`` this runs eagerly (a graph break): the ids' values pick rows
        through a numpy index and the table's hooks, which Dynamo cannot trace; the layers
        around it compile."""
        ids = _checked_ids(ids, self.mode, offsets, per_sample_weights)
        if (self.num_embeddings is not None and ids.numel()
                and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings)):
            raise IndexError(f"DynamicEmbedding: ids must lie in [0, {self.num_embeddings}) (num_embeddings, as the "
                             f"nn.Embedding it replaces), got ids from {int(ids.min())} to {int(ids.max())}")
        unique, inverse, occurrences = distinct_ids_and_counts(ids.reshape(-1))
        create = self.training and torch.is_grad_enabled()
        if self._pool_where_rows_live(unique, ids, offsets, per_sample_weights):
            return self._pooled(ids, offsets, per_sample_weights, create)
        rows = self.table.lookup(unique, create=create, occurrences=occurrences)
        if torch.is_grad_enabled():
            rows.requires_grad_()
            rows.register_hook(lambda grad: self._record(unique, grad))
        inverse = inverse.reshape(ids.shape)
        if self.mode is None:
            return nn.functional.embedding(inverse, rows)
        return nn.functional.embedding_bag(inverse, rows, offsets, mode=self.mode,
                                           per_sample_weights=per_sample_weights)

    def _record(self, ids: torch.Tensor, grad: torch.Tensor) -> None:
        self._pending.append((ids, grad.detach()))

    def _pool_where_rows_live(self, unique: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor | None,
                              per_sample_weights: torch.Tensor | None) -> bool:
        """Whether the table should pool the bags where its rows are: a bag mode, and the table says
        it moves fewer bytes (on ps tasks: a partial row per bag and ps task, against one per id)."""
        if self.mode is None:
            return False
        if per_sample_weights is not None and per_sample_weights.requires_grad:
            return False  # their gradient needs the rows here
        num_bags = ids.shape[0] if offsets is None else offsets.numel()
        return self.table.prefers_pooling(num_bags, unique.numel())

    def _pooled(self, ids: torch.Tensor, offsets: torch.Tensor | None,
                per_sample_weights: torch.Tensor | None, create: bool) -> torch.Tensor:
        assert self.mode is not None
        layout = bag_layout(ids, offsets, per_sample_weights, self.mode, self.weight.dtype)
        pooled = self.table.pooled_lookup(layout, create)
        if torch.is_grad_enabled():
            pooled.requires_grad_()
            pooled.register_hook(lambda grad: self._pending_bags.append((layout, grad.detach())))
        return pooled

    def apply_row_gradients(self, optimizer: RowOptimizer) -> None:
        """Applies the row gradients recorded since the last step with ``optimizer``, then evicts.

        Called by the step of an optimizer that holds ``weight``; call it yourself only
        to train the rows without one.
        """
        pending, self._pending = self._pending, []
        bags, self._pending_bags = self._pending_bags, []
        if bags:  # pooled where the rows live: push bag gradients, each row's expanded there
            self.table.push_bags(_as_one_layout(pending, bags), optimizer)
            return
        if len(pending) == 1:  # one forward since the last step: its distinct ids, as the table looked them up
            ids, grads = pending[0][0], pending[0][1].reshape(-1, self.embedding_dim)
        else:
            ids = torch.cat([i for i, _ in pending]) if pending else torch.zeros(0, dtype=torch.int64)
            grads = (torch.cat([g.reshape(-1, self.embedding_dim) for _, g in pending]) if pending
                     else torch.zeros(0, self.embedding_dim, dtype=self.weight.dtype))
        self.table.push(ids, grads, optimizer)

    def table_stats(self) -> list[dict[str, int]]:
        """Rows and bytes per place the rows live: one entry per ps task (one in all on one device)."""
        return [{"ps": k, "rows": rows, "bytes": size} for k, (rows, size) in enumerate(self.table.stats())]

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        register_table_module(self)  # a copy sent to a worker trains its rows there
        install_row_updates()

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        if tables_left_out():  # a delta backup saves the tables by delta_state_dict
            return
        _flatten(self.table.export(), prefix, destination)

    def _load_from_state_dict(self, state_dict: Mapping[str, Any], prefix: str, local_metadata: dict, strict: bool,
                              missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
        if tables_left_out():
            return
        keys = [prefix + key for key in (*_TABLE_KEYS, "_extra_state")]
        absent = [key for key in keys if key not in state_dict]
        if absent:
            missing_keys.extend(absent)
            return
        try:
            self.table.load(_unflatten(state_dict, prefix))
        except (TypeError, ValueError, KeyError) as exc:
            error_msgs.append(f"{prefix or 'DynamicEmbedding'}: {exc}")

    def delta_state_dict(self, full: bool = False) -> dict[str, Any]:
        """A new save point of the table: what changed since the previous one, or (``full=True``) every row.

        A delta holds the rows made, read or updated since the table's previous save point
        (with their optimizer state, counts and last-seen steps, as ``state_dict()`` names
        them), ``removed`` (the ids evicted since, as tombstones), the admission sketch and
        ``_extra_state`` naming the chain (``table_id``, ``base``, ``sequence``). With
        ``full=True`` it is a ``state_dict()`` that starts a chain (load it with
        ``load_state_dict``). Save either with ``unison.save_checkpoint`` (atomic, on the chief).
        On ps tasks the parts are gathered from every ps task, and each one's save point
        moves: call it from one process (the chief; under the hybrid strategy, worker 0).

        Raises:
            ValueError: ``full=False`` before any save point (the first save of a chain is
                full), or after loading a full checkpoint taken between save points.
        """
        destination: dict[str, Any] = {}
        _flatten(self.table.export_delta(full), "", destination)
        return destination

    def load_delta_state_dict(self, delta: Mapping[str, Any]) -> None:
        """Applies a ``delta_state_dict()`` of this table's chain (on one device, or any number of ps tasks).

        Loading the chain's full checkpoint (``load_state_dict``) and then its deltas in
        order gives the table the full checkpoint at the last delta would (ids, rows,
        optimizer state, counts, admission state; idle seconds excepted: clocks are not
        compared).

        Raises:
            ValueError: a delta of another table, out of order or already applied (naming
                both), or one that does not fit (dim, dtype, seed, optimizer state); the table
                is left as it was.
        """
        if not isinstance(delta, Mapping) or "removed" not in delta or "_extra_state" not in delta:
            got = sorted(delta) if isinstance(delta, Mapping) else type(delta).__name__
            raise ValueError(f"DynamicEmbedding.load_delta_state_dict: not a delta (needs 'removed' and "
                             f"'_extra_state'), got {got}; fix: pass what delta_state_dict() returned (a full one, "
                             f"delta_state_dict(full=True) or state_dict(), loads with load_state_dict)")
        self.table.apply_delta(_unflatten(delta, ""))

    def extra_repr(self) -> str:
        mode = f", mode={self.mode!r}" if self.mode else ""
        return f"{self.embedding_dim}{mode}, rows={self.num_rows}"


def _flatten(export: dict[str, Any], prefix: str, destination: dict[str, Any]) -> None:
    """A table export (or delta) as state-dict entries under ``prefix``."""
    for key in (*_TABLE_KEYS, *POLICY_KEYS, "removed"):
        if key in export:
            destination[prefix + key] = export[key]
    for name, values in export["state"].items():
        destination[f"{prefix}state.{name}"] = values
    destination[prefix + "_extra_state"] = export["meta"]


def _unflatten(state_dict: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """The table export (or delta) that :func:`_flatten` wrote under ``prefix``."""
    state_prefix = prefix + "state."
    export = {key: state_dict[prefix + key] for key in (*_TABLE_KEYS, *POLICY_KEYS, "removed")
              if prefix + key in state_dict}
    export["state"] = {key[len(state_prefix):]: value for key, value in state_dict.items()
                       if key.startswith(state_prefix)}
    export["meta"] = state_dict[prefix + "_extra_state"]
    return export


def _as_one_layout(pending: list[tuple[torch.Tensor, torch.Tensor]],
                   bags: list[tuple[BagLayout, torch.Tensor]]) -> tuple[BagLayout, torch.Tensor]:
    """Every recorded gradient as bags of one layout: a row gradient is a bag of one id, weight 1."""
    parts = list(bags) + [(BagLayout(ids, torch.arange(ids.numel()), torch.ones(ids.numel(), dtype=grad.dtype),
                                     ids.numel()), grad.reshape(ids.numel(), -1)) for ids, grad in pending]
    ids, bag_index, weights, grads, start = [], [], [], [], 0
    for layout, grad in parts:
        ids.append(layout.ids)
        bag_index.append(layout.bags + start)
        weights.append(layout.weights)
        grads.append(grad)
        start += layout.num_bags
    return BagLayout(torch.cat(ids), torch.cat(bag_index), torch.cat(weights), start), torch.cat(grads)


def _checked_ids(ids: Any, mode: str | None, offsets: Any, per_sample_weights: Any) -> torch.Tensor:
    """``ids`` as given, or an error that names the argument and the fix."""
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"DynamicEmbedding: `ids` must be an int64 tensor of feature ids, got {ids!r:.80}; "
                        f"fix: hash string features to int64 first")
    if mode is None and (offsets is not None or per_sample_weights is not None):
        raise ValueError("DynamicEmbedding: `offsets` and `per_sample_weights` pool bags of ids; "
                         "build the module with mode='sum' or mode='mean'")
    if mode is not None and offsets is None and ids.dim() != 2:
        raise ValueError(f"DynamicEmbedding(mode={mode!r}): `ids` must be 2-D (equal bags, one per row) or 1-D "
                         f"with `offsets`, got shape {tuple(ids.shape)}")
    if mode is not None and offsets is not None and ids.dim() != 1:
        raise ValueError(f"DynamicEmbedding(mode={mode!r}): with `offsets`, `ids` must be 1-D, "
                         f"got shape {tuple(ids.shape)}")
    if per_sample_weights is not None and mode != "sum":
        raise ValueError(f"DynamicEmbedding(mode={mode!r}): `per_sample_weights` needs mode='sum' (as nn.EmbeddingBag)")
    return ids.to(torch.int64)


def _tables_of_scope() -> TableFactory:
    """The ``tables`` component of the current strategy (the default one's outside any scope: this process)."""
    return get_strategy().extended.components.tables
