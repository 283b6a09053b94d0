"""A count-min sketch over int64 ids in torch tensors: bounded memory for the counts of ids without a row.

Feature admission needs how often each id was seen before it gets a row, and most ids of a
click stream are seen once or twice: keeping an exact counter per id would cost about what
the rows it saves cost. A count-min sketch (Cormode and Muthukrishnan, 2005) keeps
``depth`` rows of ``width`` counters; an id adds its occurrences to one counter per row,
chosen by an independent hash of the id (:func:`~unison._embeddings.tables.id_hashing.bucket_of`
with a salt per row), and its estimate is the smallest of its counters. Estimates are never
below the true count; they exceed it only when every one of the id's counters is shared
with other ids (each row with probability about ``1 - exp(-ids / width)`` for ``ids``
distinct ids counted), so a table's admission can only come early, never late, and a
test's few ids are counted exactly. ``benchmarks/table_policies.py`` measures the rate.

Removal (an admitted id takes its count out, so an evicted id starts again from 0)
subtracts the estimate from each of the id's counters, clamped at 0.

Sketches of the same shape merge by their elementwise maximum: that is how shards'
sketches are gathered and re-split. A sketch cannot be split by id, so every new shard
takes the merged counters of all old ones. The maximum keeps each id's estimate at least
its count on the shard that counted it (never below the truth, and exact where its
counters are its own, as for a test's ids), and unlike a sum it does not multiply a
sketch that was copied to several shards when they are merged again. What it gives up:
an id admitted on one shard after a re-split keeps its old count in the other shards'
copies, so if its row is evicted later it can be admitted early.
"""

from __future__ import annotations

from typing import final

import torch

from unison._embeddings.tables.id_hashing import bucket_of, splitmix64_int

__all__ = ["CountMinSketch"]

_ROW_SALT = 0x5851F42D4C957F2D  # per-row salts: splitmix64 of this plus the row number


@final
class CountMinSketch:
    """``depth`` x ``width`` int32 counters, allocated on the first count (a table that never counts holds none)."""

    def __init__(self, width: int, depth: int) -> None:
        self.width, self.depth = width, depth
        self._salts = [splitmix64_int(_ROW_SALT + row) for row in range(depth)]
        self._cells: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of the counters (0 until the first count)."""
        return 0 if self._cells is None else self._cells.numel() * self._cells.element_size()

    @property
    def max_bytes(self) -> int:
        """Bytes of the counters once allocated: the bound of the sketch's memory."""
        return self.width * self.depth * 4

    def cells(self) -> torch.Tensor:
        """A copy of the counters, ``[depth, width]`` int32 (zeros before the first count)."""
        if self._cells is None:
            return torch.zeros(self.depth, self.width, dtype=torch.int32)
        return self._cells.clone()

    def positions(self, ids: torch.Tensor) -> torch.Tensor:
        """``[depth, n]`` positions of each id's counters: hashed once, for several of the calls below."""
        return self._flat(ids)

    def _flat(self, ids: torch.Tensor) -> torch.Tensor:
        """``[depth, n]`` positions of each id's counter in the flattened counters."""
        return torch.stack([bucket_of(ids, salt, self.width) + row * self.width
                            for row, salt in enumerate(self._salts)])

    def _allocated(self) -> torch.Tensor:
        if self._cells is None:
            self._cells = torch.zeros(self.depth, self.width, dtype=torch.int32)
        return self._cells

    def estimate(self, ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Int64 count of each id of a 1-D int64 tensor: at least its true count (``positions``: theirs, if known)."""
        if self._cells is None or not ids.numel():
            return torch.zeros(ids.numel(), dtype=torch.int64)
        return self._cells.view(-1)[self._flat(ids) if positions is None else positions].amin(0).to(torch.int64)

    def add(self, ids: torch.Tensor, amounts: torch.Tensor, positions: torch.Tensor | None = None) -> None:
        """Counts ``amounts`` (int, one per id; repeated ids add up) for ``ids`` (``positions``: theirs, if known)."""
        if ids.numel():
            flat = (self._flat(ids) if positions is None else positions).reshape(-1)
            self._allocated().view(-1).index_add_(0, flat, amounts.to(torch.int32).repeat(self.depth))

    def remove(self, ids: torch.Tensor, amounts: torch.Tensor, positions: torch.Tensor | None = None) -> None:
        """Takes ``amounts`` (an estimate of distinct ``ids``, at most each of their counters) back out."""
        if ids.numel() and self._cells is not None:
            flat = (self._flat(ids) if positions is None else positions).reshape(-1)
            cells = self._cells.view(-1)
            cells.index_add_(0, flat, amounts.to(torch.int32).neg().repeat(self.depth))
            touched = flat.unique()  # only these can have gone below zero: not a pass over the whole sketch
            cells[touched] = cells[touched].clamp_(min=0)

    def merge(self, cells: torch.Tensor, source: str) -> None:
        """Merges another sketch's counters (``cells()`` of one with the same width and depth): the
        elementwise maximum, so no id's estimate falls below either sketch's.

        Raises:
            ValueError: naming ``source`` when the shapes differ.
        """
        if tuple(cells.shape) != (self.depth, self.width):
            raise ValueError(f"{source} holds admission counts of a sketch of depth x width {tuple(cells.shape)}, this "
                             f"table's is {(self.depth, self.width)}; fix: build the table with "
                             f"sketch_width={cells.shape[-1]}, sketch_depth={cells.shape[0]} (as the table that "
                             f"saved it)")
        if bool(cells.any()):
            torch.maximum(self._allocated(), cells.to(torch.int32), out=self._allocated())
