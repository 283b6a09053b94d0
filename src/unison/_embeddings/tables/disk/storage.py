"""``DiskStorage``: where a dynamic table keeps the rows beyond its memory budget, and the store holding them.

A recommendation table can outgrow the memory of the processes that own its rows (this
one, or each ps task). With ``DynamicEmbedding(..., storage=DiskStorage(path,
memory_budget_bytes=...))`` each owner keeps its hot rows (with their optimizer state and
counters) in memory within the budget and the rest in an embedded key-value store under
``path``; a lookup of a cold row brings it back (``tiered_table``).

The store is LMDB (the ``lmdb`` package, the ``disk`` extra), chosen by measurement against
RocksDB (``rocksdict``) and LevelDB (``plyvel``) on the tier's own access pattern, batched
reads and writes of rows keyed by int64 id (``benchmarks/kv_stores.py``; numbers in
``benchmarks/RESULTS.md``): it read rows fastest, wrote them as fast as RocksDB, is one
small C library with no background threads (a ps task forks nothing), and maps its file so
the operating system caches recently read pages. No durability is asked of it: the
checkpoint is the truth, so it is opened without ``fsync``.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any, final

import torch

__all__ = ["DiskStorage", "KeyValueStore", "INSTALL_HINT", "CACHE_POLICIES"]

CACHE_POLICIES = ("lru", "lfu")
INSTALL_HINT = "pip install 'unison[disk]' (or: pip install lmdb)"
_INDEX_BYTES_PER_ROW = 32  # an id index entry (id, slot) at a load factor of at most one half
_MAP_SIZE = 1 << 40  # address space, not disk: LMDB's file grows with its pages


@final
class DiskStorage:
    """Rows beyond a memory budget on local disk, the hot rows cached in memory.

    Each place that owns rows of the table (this process on one device, each ps task for its
    shard) keeps at most ``memory_budget_bytes`` of them in memory: the hot rows' values,
    optimizer state and counters, and the in-memory index of the cold ones (id, count, last
    step: about 75 bytes a row); the rest live in an LMDB store in its own directory,
    ``path/local`` on one device and ``path/ps-K/<table>`` on ps task ``K``. After each
    optimizer step the rows over the budget, least recently used first (``cache="lru"``) or
    least often (``"lfu"``), spill to disk in one batch; the step's own rows stay. A lookup
    of a cold row reads it back with its state and counters. Spilling changes no value: a
    table trains, evicts, admits and checkpoints as it would in memory.

    The files belong to the table: a table made (or loaded from a checkpoint) starts from an
    empty directory and removes what an earlier run left there (the checkpoint is the
    truth: rows on disk that it does not hold are discarded). Give each ``DynamicEmbedding``
    its own ``path``.

    Args:
        path: a directory on local disk (made if missing), writable by the owners of the rows.
        memory_budget_bytes: the bytes of rows kept in memory per owner (per ps task for its
            shard of this table; the whole table on one device); at least one row's.
        cache: which rows stay in memory, ``"lru"`` (most recently used) or ``"lfu"`` (most used).

    Raises:
        ValueError: a budget below 1 byte or a cache policy not named above (a budget too small
            for one row is refused by ``DynamicEmbedding``, which knows the row's size).
        ImportError: the ``lmdb`` package is not installed, naming the command that installs it.

    tf.distribute equivalent: none; DeepRec's DRAM+SSD hash storage and TorchRec's SSD tables
    (GPU only) are the nearest.

    Example:
        >>> import tempfile, unison
        >>> storage = unison.embeddings.DiskStorage(tempfile.mkdtemp(), memory_budget_bytes=64 << 20)
        >>> emb = unison.DynamicEmbedding(16, storage=storage)
        >>> emb(torch.tensor([3, 5])).shape
        torch.Size([2, 16])
    """

    def __init__(self, path: str | os.PathLike[str], memory_budget_bytes: int, cache: str = "lru") -> None:
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise TypeError(f"DiskStorage: `path` must be a directory path (str or os.PathLike), got {path!r}")
        if isinstance(memory_budget_bytes, bool) or not isinstance(memory_budget_bytes, int) or memory_budget_bytes < 1:
            raise ValueError(f"DiskStorage: `memory_budget_bytes` must be an int >= 1 (bytes of rows kept in memory "
                             f"per ps task), got {memory_budget_bytes!r}; fix: e.g. memory_budget_bytes=512 << 20")
        if cache not in CACHE_POLICIES:
            raise ValueError(f"DiskStorage: `cache` must be one of {CACHE_POLICIES} (which rows stay in memory), "
                             f"got {cache!r}; fix: cache='lru'")
        _lmdb()
        self.path = Path(path)
        self.memory_budget_bytes = memory_budget_bytes
        self.cache = cache

    def __repr__(self) -> str:
        return f"DiskStorage({str(self.path)!r}, memory_budget_bytes={self.memory_budget_bytes}, cache={self.cache!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DiskStorage) and repr(self) == repr(other)

    def __hash__(self) -> int:
        return hash(repr(self))

    def check_fits(self, owner: str, embedding_dim: int, dtype: torch.dtype) -> None:
        """Refuses a budget that holds not one row of ``embedding_dim`` values (without optimizer state)."""
        row = embedding_dim * torch.empty(0, dtype=dtype).element_size() + 25 + _INDEX_BYTES_PER_ROW
        if self.memory_budget_bytes < row:
            raise ValueError(f"{owner}: `storage.memory_budget_bytes` is {self.memory_budget_bytes}, less than one "
                             f"row of {embedding_dim} {dtype} values and its counters ({row} bytes, before optimizer "
                             f"state); fix: DiskStorage(..., memory_budget_bytes=...) of at least {row}, in practice "
                             f"the bytes of the hot rows with their state")

    def open(self, place: str) -> KeyValueStore:
        """A new, empty store for the rows of ``place`` (``"local"``, ``"ps-0/<table>"``), its directory's
        earlier contents removed."""
        return KeyValueStore(self.path / place)


def _lmdb() -> Any:
    try:
        import lmdb
    except ImportError as exc:
        raise ImportError(f"DiskStorage keeps cold rows in LMDB, and the `lmdb` package is not installed; fix: "
                          f"{INSTALL_HINT}") from exc
    return lmdb


@final
class KeyValueStore:
    """Values by int64 key in LMDB, read and written in batches; one per table shard.

    Opened in a fresh subdirectory of ``directory``, whose other contents (an earlier run's,
    or a table this one replaces, still readable by its open handle until closed) are removed.
    """

    def __init__(self, directory: Path) -> None:
        lmdb = _lmdb()
        self._error = lmdb.Error
        try:
            directory.mkdir(parents=True, exist_ok=True)
            for stale in directory.iterdir():
                if stale.is_dir() and stale.name.startswith("rows-"):
                    shutil.rmtree(stale, ignore_errors=True)
            self.directory = directory / f"rows-{uuid.uuid4().hex}"
            self._env = lmdb.open(str(self.directory), map_size=_MAP_SIZE, sync=False, metasync=False,
                                  readahead=False, max_dbs=0)
        except (OSError, lmdb.Error) as exc:
            raise ValueError(f"DiskStorage: cannot keep rows under `path` {str(directory)!r}: {exc}; fix: a "
                             f"directory on local disk that this process may write") from exc

    def put(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Stores ``values[i]`` (a row of bytes, ``[n, width]`` uint8) under ``keys[i]``, replacing any."""
        with self._env.begin(write=True) as txn:
            txn.cursor().putmulti(zip(_keys(keys), _rows(values)))

    def get(self, keys: torch.Tensor, width: int) -> torch.Tensor:
        """``[n, width]`` uint8: the values of ``keys``, each present."""
        with self._env.begin() as txn:
            found = [value for _, value in txn.cursor().getmulti(_keys(keys))]
        if len(found) != keys.numel():
            raise KeyError(f"DiskStorage: {keys.numel() - len(found)} of {keys.numel()} rows missing from "
                           f"{str(self.directory)!r} (were its files changed by another process?)")
        return torch.frombuffer(bytearray(b"".join(found)), dtype=torch.uint8).reshape(keys.numel(), width)

    def delete(self, keys: torch.Tensor) -> None:
        """Removes ``keys`` (each present)."""
        with self._env.begin(write=True) as txn:
            for key in _keys(keys):
                txn.delete(key)

    def __len__(self) -> int:
        """Values stored."""
        return int(self._env.stat()["entries"])

    @property
    def disk_bytes(self) -> int:
        """Bytes the store's files take on disk (allocated blocks)."""
        return sum(f.stat().st_blocks * 512 for f in self.directory.iterdir() if f.is_file())

    def close(self) -> None:
        """Closes the store and removes its files (they hold nothing a checkpoint does not)."""
        self._env.close()
        shutil.rmtree(self.directory, ignore_errors=True)


def _keys(ids: torch.Tensor) -> list[bytes]:
    raw = ids.numpy().astype(">i8").tobytes()
    return [raw[i:i + 8] for i in range(0, len(raw), 8)]


def _rows(values: torch.Tensor) -> list[bytes]:
    raw, width = values.contiguous().numpy().tobytes(), values.shape[1]
    return [raw[i:i + width] for i in range(0, len(raw), width)]
