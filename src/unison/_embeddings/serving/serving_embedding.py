"""``unison.embeddings.ServingEmbedding``: a read-only table in one process, loaded from a serving export.

A model trained with ``DynamicEmbedding`` is served while it trains: the trainer writes a
full export now and then and a delta export often; a serving process loads the full one
and applies each delta in place, between lookups. Lookups never make rows: an id without
a row reads ``default`` (a bag pools it as such).

Ids resolve through the same open-addressing index as the trained table
(:class:`~unison._embeddings.tables.id_index.IdIndex`: a probe or two per id); rows sit in
one growable tensor by slot. :meth:`ServingEmbedding.apply_delta` reads and checks the
whole delta first, then changes rows, adds new ids and drops removed ones under a lock
that lookups also take, so a lookup sees the table before or after a delta, never
between; its time follows the delta's size, not the table's.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from typing import final

import torch
from torch import nn

from unison._embeddings.serving.files import read_export
from unison._embeddings.tables.distinct_ids import distinct_ids
from unison._embeddings.tables.id_index import IdIndex
from unison._interpose.eager_under_compile import eager_under_compile

__all__ = ["ServingEmbedding", "ReadDelta"]

_MODES = (None, "sum", "mean")


@dataclasses.dataclass(frozen=True)
class ReadDelta:
    """A delta export read and checked against a table (:meth:`ServingEmbedding.read_delta`), not yet applied."""

    base: int
    number: int
    ids: torch.Tensor
    rows: torch.Tensor
    removed: torch.Tensor


@final
class ServingEmbedding(nn.Module):
    """A read-only embedding table loaded from ``unison.embeddings.export_for_serving``'s files.

    Build it with :meth:`load`. ``forward(ids)`` (``mode=None``: ``[*ids.shape, dim]``) or
    ``forward(ids, offsets, per_sample_weights)`` (``mode="sum"``/``"mean"``: one pooled row
    per bag, as ``nn.EmbeddingBag``) answers as the trained ``DynamicEmbedding`` did in
    evaluation, with ``default`` for ids without a row. It has no parameters and no
    gradient; it is safe to call from several threads while :meth:`apply_delta` runs.

    Example:
        >>> import tempfile, os, unison
        >>> emb = unison.DynamicEmbedding(4, mode="sum")
        >>> _ = emb(torch.tensor([[1, 2], [3, 4]]))
        >>> path = os.path.join(tempfile.mkdtemp(), "export-0")
        >>> _ = unison.embeddings.export_for_serving(emb, path)
        >>> served = unison.embeddings.ServingEmbedding.load(path)
        >>> torch.equal(served(torch.tensor([[1, 2]])), emb.eval()(torch.tensor([[1, 2]])))
        True

    tf.distribute equivalent: none (TensorFlow Serving loads a SavedModel whole).
    """

    def __init__(self, embedding_dim: int, dtype: torch.dtype, mode: str | None, default: float,
                 export_id: str, number: int) -> None:
        super().__init__()
        if mode not in _MODES:
            raise ValueError(f"ServingEmbedding: `mode` must be None, 'sum' or 'mean', got {mode!r}")
        self.embedding_dim, self.mode, self.default = embedding_dim, mode, float(default)
        self.export_id, self.number = export_id, number
        """The export chain and the number of the last export applied."""
        self._index = IdIndex()
        self._rows = torch.zeros(0, embedding_dim, dtype=dtype)
        self._free: list[torch.Tensor] = []
        self._used = 0
        self._lock = threading.Lock()

    @classmethod
    def load(cls, path: str | os.PathLike[str], default: float = 0.0) -> ServingEmbedding:
        """A table holding a full serving export's rows.

        Args:
            path: a directory written by ``export_for_serving(module, path)`` (a full one).
            default: the value of every column of an id without a row.

        Raises:
            FileNotFoundError: no export at ``path``.
            ValueError: a delta export (load its full export, then ``apply_delta``), or damaged files.
            TypeError: ``default`` is not a number.
        """
        if isinstance(default, bool) or not isinstance(default, (int, float)):
            raise TypeError(f"ServingEmbedding.load: `default` must be a number (every column of an unknown id), "
                            f"got {default!r}")
        manifest, arrays = read_export(path)
        if manifest["kind"] != "full":
            raise ValueError(f"ServingEmbedding.load: {os.fspath(path)!r} is delta export {manifest['number']} of "
                             f"chain {manifest['export_id']!r}; fix: load that chain's full export, then apply its "
                             f"deltas in order with apply_delta")
        table = cls(manifest["embedding_dim"], arrays["rows"].dtype, manifest["mode"], default,
                    manifest["export_id"], manifest["number"])
        table._upsert(arrays["ids"], arrays["rows"])
        return table

    @property
    def num_rows(self) -> int:
        """Ids with a row."""
        return len(self._index)

    def apply_delta(self, path: str | os.PathLike[str]) -> None:
        """Applies the next delta export of this table's chain, in place, while lookups go on.

        Raises:
            ValueError: an export of another chain, out of order, already applied, a full
                export, or one of another shape; nothing is changed.
        """
        self.apply_read_delta(self.read_delta(path))

    def read_delta(self, path: str | os.PathLike[str], after: int | None = None) -> ReadDelta:
        """Reads and checks the delta export at ``path`` as the one that follows export ``after``
        (default: this table's ``number``), changing nothing; :meth:`apply_read_delta` applies it.

        The two halves of :meth:`apply_delta`, for a caller that checks several tables'
        deltas (or several deltas in a row) before it changes any table.

        Raises:
            ValueError: as :meth:`apply_delta`.
        """
        manifest, arrays = read_export(path)
        where = f"ServingEmbedding.apply_delta({os.fspath(path)!r})"
        at = self.number if after is None else after
        if manifest["kind"] != "delta":
            raise ValueError(f"{where}: a full export (chain {manifest['export_id']!r}); nothing was changed. fix: "
                             f"ServingEmbedding.load it as a new table, or pass a delta export")
        if manifest["export_id"] != self.export_id:
            raise ValueError(f"{where}: a delta of export chain {manifest['export_id']!r} but this table is chain "
                             f"{self.export_id!r} (at export {at}); nothing was changed. fix: load the full "
                             f"export of chain {manifest['export_id']!r}")
        if manifest["base"] != at:
            what = "was already applied" if manifest["number"] <= at else "is out of order"
            raise ValueError(f"{where}: export {manifest['base']} -> {manifest['number']} of chain "
                             f"{self.export_id!r}, but this table is at export {at}: it {what}; nothing "
                             f"was changed. fix: apply the deltas in order, each once")
        if manifest["embedding_dim"] != self.embedding_dim or arrays["rows"].dtype != self._rows.dtype:
            raise ValueError(f"{where}: rows of dim {manifest['embedding_dim']} {arrays['rows'].dtype}, this table's "
                             f"are {self.embedding_dim} {self._rows.dtype}; nothing was changed")
        return ReadDelta(int(manifest["base"]), int(manifest["number"]), arrays["ids"], arrays["rows"],
                         arrays["removed"])

    def apply_read_delta(self, delta: ReadDelta) -> None:
        """Applies a delta from :meth:`read_delta` under the lookups' lock.

        Raises:
            ValueError: the table is no longer at the delta's base (another delta came first);
                nothing is changed.
        """
        with self._lock:
            if delta.base != self.number:
                raise ValueError(f"ServingEmbedding.apply_read_delta: the delta follows export {delta.base}, this "
                                 f"table is at export {self.number}; nothing was changed. fix: read it again")
            slots = self._index.find(delta.removed)
            present = slots >= 0
            if bool(present.any()):
                self._index.remove(delta.removed[present])
                self._free.append(slots[present])
            self._upsert(delta.ids, delta.rows)
            self.number = delta.number

    def _upsert(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Rows of distinct ids replaced, or stored in free or new slots (the caller holds the lock or owns self)."""
        slots, ends = self._index.find_with_ends(ids)
        hit = slots >= 0
        if bool(hit.any()):
            self._rows[slots[hit]] = rows[hit]
        missing = (slots < 0).nonzero().squeeze(1)
        if not missing.numel():
            return
        free = torch.cat(self._free) if self._free else torch.zeros(0, dtype=torch.int64)
        reused = free[:missing.numel()]
        fresh = missing.numel() - reused.numel()
        self._free = [free[reused.numel():]] if free.numel() > reused.numel() else []
        new = torch.cat([reused, torch.arange(self._used, self._used + fresh)])
        if self._used + fresh > self._rows.shape[0]:
            grown = torch.empty(max(2 * self._rows.shape[0], self._used + fresh), self.embedding_dim,
                                dtype=self._rows.dtype)
            grown[:self._used] = self._rows[:self._used]
            self._rows = grown
        self._used += fresh
        self._rows[new] = rows.index_select(0, missing)
        self._index.insert(ids.index_select(0, missing), new, ends.index_select(0, missing))

    def _rows_of(self, unique: torch.Tensor) -> torch.Tensor:
        with self._lock:
            slots = self._index.find(unique)
            present = slots >= 0
            rows = torch.full((unique.numel(), self.embedding_dim), self.default, dtype=self._rows.dtype)
            rows[present] = self._rows.index_select(0, slots[present])
        return rows

    @eager_under_compile
    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Each id's row, ``[*ids.shape, dim]``, never pooled whatever ``mode`` (unknown ids read ``default``).

        What a server answers for a list of ids: the stored rows exactly (a bag of one id
        pooled by ``forward`` would add it to zero, turning ``-0.0`` into ``0.0``).
        """
        self._check_ids(ids)
        unique, inverse = distinct_ids(ids.reshape(-1).to(torch.int64).cpu())
        return nn.functional.embedding(inverse.reshape(ids.shape), self._rows_of(unique))

    def _check_ids(self, ids: object) -> None:
        if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"ServingEmbedding: `ids` must be an int64 tensor of feature ids, got {ids!r:.80}")

    @eager_under_compile
    def forward(self, ids: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        """Rows of ``ids`` (or, with ``mode``, one pooled row per bag); unknown ids read ``default``."""
        self._check_ids(ids)
        if self.mode is None and (offsets is not None or per_sample_weights is not None):
            raise ValueError("ServingEmbedding: `offsets`/`per_sample_weights` pool bags; this table was exported "
                             "from a DynamicEmbedding with mode=None")
        if self.mode is not None and offsets is None and ids.dim() != 2:
            raise ValueError(f"ServingEmbedding(mode={self.mode!r}): `ids` must be 2-D (equal bags) or 1-D with "
                             f"`offsets`, got shape {tuple(ids.shape)}")
        unique, inverse = distinct_ids(ids.reshape(-1).to(torch.int64).cpu())
        rows = self._rows_of(unique)
        inverse = inverse.reshape(ids.shape)
        if self.mode is None:
            return nn.functional.embedding(inverse, rows)
        return nn.functional.embedding_bag(inverse, rows, offsets, mode=self.mode,
                                           per_sample_weights=per_sample_weights)

    def extra_repr(self) -> str:
        mode = f", mode={self.mode!r}" if self.mode else ""
        return f"{self.embedding_dim}{mode}, rows={self.num_rows}, export={self.export_id[:8]}#{self.number}"


