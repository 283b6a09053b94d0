"""The ``Table`` contract: what a ``DynamicEmbedding`` asks of the rows it trains, wherever they live.

Two implementations: :class:`~unison._embeddings.tables.local_table.LocalTable` (the rows in
this process) and :class:`~unison._ps.worker.remote_table.RemoteTable` (row ``id`` on ps task
``shard_of(id, M)``, reached through a client it is handed). Which one a module gets is
decided by the strategy in whose scope it is built: its ``tables`` component
(:class:`TableFactory`), never by the module testing types. :class:`TableConfig` is what
every shard of a table, and every worker, agree on.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from unison._embeddings.optim.row_optimizers import RowOptimizer
from unison._embeddings.tables.admission_policies import AdmissionPolicy
from unison._embeddings.tables.bag_layout import BagLayout
from unison._embeddings.tables.capacity import RowCapacity
from unison._embeddings.tables.disk.storage import DiskStorage
from unison._embeddings.tables.eviction import EvictionPolicy
from unison._embeddings.tables.initializers import Initializer

if TYPE_CHECKING:
    from unison._embeddings.tables.disk.tiered_table import TieredTable
    from unison._embeddings.tables.local_table import LocalTable

__all__ = ["Table", "TableConfig", "TableFactory", "LocalTables", "NoTables"]


@dataclasses.dataclass(frozen=True)
class TableConfig:
    """What a table (or one shard of it) is made from; every shard and every worker agree on it.

    ``capacity`` is the whole table's; :meth:`per_shard` gives what one of ``M`` shards keeps.
    ``storage`` (a disk tier) is per place that owns rows: each shard keeps its budget.
    """

    embedding_dim: int
    dtype: torch.dtype
    initializer: Initializer
    seed: int
    eviction: EvictionPolicy | None
    admission: AdmissionPolicy | None = None
    capacity: RowCapacity | None = None
    storage: DiskStorage | None = None

    def new_table(self, place: str = "local") -> LocalTable | TieredTable:
        """An empty local table (a whole table here, or one shard on a ps task); with ``storage``, one whose
        rows beyond the budget live on disk under ``storage.path / place`` (``"ps-0/<table>"`` on ps task 0)."""
        from unison._embeddings.tables.local_table import LocalTable

        capacity = self.capacity
        if self.storage is not None:
            from unison._embeddings.tables.disk.tiered_table import TieredTable

            return TieredTable(self.embedding_dim, storage=self.storage, place=place, dtype=self.dtype,
                               initializer=self.initializer, seed=self.seed, eviction=self.eviction,
                               admission=self.admission, capacity=capacity)
        return LocalTable(self.embedding_dim, dtype=self.dtype, initializer=self.initializer, seed=self.seed,
                          eviction=self.eviction, admission=self.admission,
                          capacity=None if capacity is None else capacity.rows,
                          capacity_policy="lru" if capacity is None else capacity.policy)

    def per_shard(self, num_shards: int) -> TableConfig:
        """The config of one of ``num_shards`` shards: a capacity of ``ceil(capacity / num_shards)`` rows."""
        if self.capacity is None:
            return self
        return dataclasses.replace(self, capacity=self.capacity.per_shard(num_shards))

    def describe(self) -> str:
        """The config in words, to compare two workers' (the objects are rebuilt by pickling)."""
        return (f"dim={self.embedding_dim}, dtype={self.dtype}, initializer={self.initializer!r}, "
                f"seed={self.seed}, eviction={self.eviction!r}, admission={self.admission!r}, "
                f"capacity={self.capacity!r}, storage={self.storage!r}")


@runtime_checkable
class Table(Protocol):
    """The rows of one embedding table, as a module trains them."""

    @property
    def embedding_dim(self) -> int:
        """Columns per row."""
        ...

    @property
    def num_rows(self) -> int:
        """Rows that exist (over every shard)."""
        ...

    def lookup(self, ids: torch.Tensor, create: bool = True, occurrences: torch.Tensor | None = None) -> torch.Tensor:
        """Rows of distinct ``ids``; missing rows are made when ``create`` (counted by ``occurrences``;
        under an admission policy only for the ids it admits: the others read zeros)."""
        ...

    def prefers_pooling(self, num_bags: int, num_distinct: int) -> bool:
        """Whether :meth:`pooled_lookup` moves fewer bytes than :meth:`lookup` for such a batch."""
        ...

    def pooled_lookup(self, layout: BagLayout, create: bool) -> torch.Tensor:
        """``[num_bags, dim]``: each bag's weighted sum of its rows."""
        ...

    def push(self, ids: torch.Tensor, grads: torch.Tensor, optimizer: RowOptimizer) -> None:
        """One optimizer step of the rows: applies ``ids``' gradients, advances the clock, evicts."""
        ...

    def push_bags(self, bags: tuple[BagLayout, torch.Tensor], optimizer: RowOptimizer) -> None:
        """:meth:`push` with one gradient per bag, expanded to its ids by their weights."""
        ...

    def export(self) -> dict[str, Any]:
        """Every row, sorted by id, with its optimizer state and counters (a checkpoint's part)."""
        ...

    def load(self, export: dict[str, Any]) -> None:
        """Replaces the rows by an export's (from any number of shards, or one process)."""
        ...

    def stats(self) -> list[tuple[int, int]]:
        """Per place the rows live (one entry here, one per ps task there): (rows, bytes)."""
        ...

    def export_delta(self, full: bool = False) -> dict[str, Any]:
        """A new save point: what changed since the previous one (``deltas``), or every row (``full``)."""
        ...

    def apply_delta(self, delta: dict[str, Any]) -> None:
        """Applies the next delta of this table's chain (refused, changing nothing, if it is not the next)."""
        ...

    def serving_export(self, delta: bool) -> dict[str, Any]:
        """Ids and rows for serving: all of them, or (``delta``) what changed since the previous export."""
        ...


@runtime_checkable
class TableFactory(Protocol):
    """A strategy's component: the table a ``DynamicEmbedding`` built in its scope gets."""

    def create_table(self, config: TableConfig) -> Table:
        """A new table made from ``config`` (made on the ps tasks, or found there, for remote rows)."""
        ...


@dataclasses.dataclass(frozen=True)
class LocalTables:
    """Tables in this process: no strategy, ``OneDeviceStrategy``."""

    def create_table(self, config: TableConfig) -> Table:
        return config.new_table("local")


@dataclasses.dataclass(frozen=True)
class NoTables:
    """A strategy whose replicas cannot share one table's rows: refuses with the fix."""

    strategy_name: str

    def create_table(self, config: TableConfig) -> Table:
        raise NotImplementedError(
            f"DynamicEmbedding in {self.strategy_name}'s scope: its rows live in this process (no strategy, "
            f"OneDeviceStrategy) or on ps tasks (ParameterServerStrategy, HybridParameterServerStrategy); build it "
            f"in one of those scopes")
