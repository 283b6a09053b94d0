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
small C library with no background threads of its own (what applies a store's writes is ours:
``row_writer``'s thread hands them to ``writer_process``'s child, which writes the same files,
as LMDB allows several processes to), and maps its file so the operating system caches
recently read pages. Little durability is asked of it: the
checkpoint is the truth, so it is opened without ``fsync`` and flushed only when a full save
seals it (``KeyValueStore.seal``), which is what a restarted process resumes from.
"""

from __future__ import annotations

import os
import shutil
import uuid
import weakref
from pathlib import Path
from typing import Any, final

import numpy as np
import torch

from unison._embeddings.tables.disk.row_writer import RowWriter
from unison._embeddings.tables.disk.writer_process import WriterProcess

__all__ = ["DiskStorage", "KeyValueStore", "INSTALL_HINT", "CACHE_POLICIES"]

CACHE_POLICIES = ("lru", "lfu")
INSTALL_HINT = "pip install 'unison[disk]' (or: pip install lmdb)"
_INDEX_BYTES_PER_ROW = 32  # an id index entry (id, slot) at a load factor of at most one half
_MAP_SIZE = 1 << 40  # address space, not disk: LMDB's file grows with its pages
_FORMAT = b"2"
"""How a store lays out its rows, recorded in it; a store of another format is not resumed from.
2: the rows database's keys are integer keys (native-order int64, ``MDB_INTEGERKEY``); 1 (or none
recorded): big-endian byte strings."""


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

    The files belong to the table, and **the checkpoint is the truth**. A full save
    (``state_dict``, ``delta_state_dict(full=True)``) seals the files: it flushes them and
    records in the checkpoint which rows were on disk. A table rebuilt on the same path (a
    restarted process or ps task) that loads that checkpoint resumes from the files: the rows
    on disk that were not written or deleted since the save stay there unread, the rows
    written after it are rolled back to the checkpoint's values, rows made after it are
    discarded, and only the save's hot rows and the rolled back ones are loaded. When the
    files cannot be proven to match (a later full save sealed them again, the machine
    restarted since they were written, they do not open, another unison version wrote them
    in another format) every row is loaded from the
    checkpoint, with a ``RuntimeWarning`` saying why. A new table leaves what an earlier run
    left on its path until it loads a checkpoint or first writes to disk, then removes it.
    Give each ``DynamicEmbedding`` its own ``path``.

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
        """A new, empty store for the rows of ``place`` (``"local"``, ``"ps-0/<table>"``); what an earlier run
        left in its directory is removed at its first write, or resumed from (``KeyValueStore.reopen``)."""
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

    The store lives in a subdirectory ``rows-<uuid>`` of ``directory``, made at the first
    write (or adopted from an earlier run by :meth:`reopen`); what else an earlier run left in
    ``directory`` is removed then, not before, so a restarted process can still resume from it.

    Beside the rows it keeps, in the same transactions, what a resume needs to prove the
    files match a checkpoint: a **seal** number (moved by :meth:`seal`, at each full save,
    flushed to disk) and the **dirty** ids, every id written or deleted since the last seal;
    and the id of the boot that wrote last (writes after a seal are not flushed, so after
    the machine restarted they cannot be trusted).

    Writes are applied in order by a process of the store's own (``writer_process``, fed by
    ``row_writer``'s thread), ended when the store is closed or collected; a read sees the
    rows still in flight. The thread holds only where the writes go (:class:`_Destination`),
    never the store: a store let go without close() is finalised where its last reference
    went, even while a write is in flight, and ends its thread and process there. ``mark``
    names the ids to record as dirty with a write: the caller marks each id once per seal
    (``ColdRows``), not at every write.
    """

    def __init__(self, directory: Path) -> None:
        lmdb = _lmdb()
        self._lmdb = lmdb
        self._env: Any = None
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"DiskStorage: cannot keep rows under `path` {str(directory)!r}: {exc}; fix: a "
                             f"directory on local disk that this process may write") from exc
        self._parent = directory
        self._process = WriterProcess(_MAP_SIZE)  # applies the writes; its child starts at the first
        self._destination = _Destination(directory / f"rows-{uuid.uuid4().hex}", self._process)
        self._writer = RowWriter(self._destination, str(directory))
        # a store dropped without close() (a table let go) still ends its thread and its writer process
        self._shut_down = weakref.finalize(self, _shut_down, self._writer, self._process)

    @property
    def directory(self) -> Path:
        """The store's own directory under its place (a resume adopts an earlier run's)."""
        return self._destination.directory

    @directory.setter
    def directory(self, path: Path) -> None:
        self._destination.directory = path

    @property
    def opened(self) -> bool:
        """Whether the store exists on disk (it is made at the first write, or reopened)."""
        return self._env is not None

    @property
    def name(self) -> str:
        """The store's directory name under its place (what a checkpoint records)."""
        return self.directory.name

    def _open(self, path: Path, create: bool) -> None:
        lmdb = self._lmdb
        try:
            env = lmdb.open(str(path), map_size=_MAP_SIZE, sync=False, metasync=False, readahead=False,
                            max_dbs=3, create=create)
            self._rows = env.open_db(b"rows", integerkey=True)
            self._dirty = env.open_db(b"dirty")
            self._meta = env.open_db(b"meta")
        except (OSError, lmdb.Error) as exc:
            raise ValueError(f"DiskStorage: cannot keep rows under `path` {str(self._parent)!r}: {exc}; fix: a "
                             f"directory on local disk that this process may write") from exc
        self._env, self.directory = env, path
        for stale in self._parent.iterdir():  # an earlier run's (or a replaced table's, still open until closed)
            if stale.is_dir() and stale.name.startswith("rows-") and stale != path:
                shutil.rmtree(stale, ignore_errors=True)

    def _writable(self) -> Any:
        """The open environment, made with seal 0 at the first write."""
        if self._env is None:
            self._open(self.directory, create=True)
            env: Any = self._env
            with env.begin(write=True) as txn:
                txn.put(b"seal", b"0", db=self._meta)
                txn.put(b"boot", _boot_id(), db=self._meta)
                txn.put(b"format", _FORMAT, db=self._meta)
        return self._env

    def put(self, keys: torch.Tensor, values: torch.Tensor, mark: torch.Tensor) -> None:
        """Stores ``values[i]`` (a row of bytes, ``[n, width]`` uint8, not changed afterwards) under ``keys[i]``,
        replacing any, and records the ids ``mark`` as dirty; returns before the disk is written."""
        self._writable()
        self._writer.submit(keys, values, mark)

    def delete(self, keys: torch.Tensor, mark: torch.Tensor) -> None:
        """Removes ``keys`` (those absent are skipped) and records the ids ``mark`` as dirty."""
        if keys.numel():
            self._writable()
            self._writer.submit(keys, None, mark)

    def get(self, keys: torch.Tensor, width: int) -> torch.Tensor:
        """``[n, width]`` uint8: the values of ``keys``, each present (on disk or in flight)."""
        out = torch.empty(keys.numel(), width, dtype=torch.uint8)
        in_flight = self._writer.overlay(keys, out)
        rest = (~in_flight).nonzero().squeeze(1)
        if not rest.numel():
            return out
        found = []
        if self._env is not None:
            wanted = keys if rest.numel() == keys.numel() else keys.index_select(0, rest)
            with self._env.begin() as txn:
                found = [value for _, value in txn.cursor(db=self._rows).getmulti(_split(_row_keys(wanted)))]
        if len(found) != rest.numel():
            raise KeyError(f"DiskStorage: {rest.numel() - len(found)} of {keys.numel()} rows missing from "
                           f"{str(self.directory)!r} (were its files changed by another process?)")
        read = torch.frombuffer(bytearray().join(found), dtype=torch.uint8).reshape(-1, width)  # one copy
        if rest.numel() == keys.numel():
            return read  # none in flight: the rows as read, no copy into ``out``
        out.index_copy_(0, rest, read)
        return out

    def flush(self) -> None:
        """Waits until every write submitted is on disk (in the page cache: flushed only by :meth:`seal`)."""
        self._writer.drain()

    def seal(self, dirty: torch.Tensor) -> int:
        """A new seal once every write is done: only the ids ``dirty`` are dirty from now on (copies on disk
        that a checkpoint taken now does not hold), and the store is flushed to disk; returns its number (a
        checkpoint taken now records it with the ids on disk)."""
        env = self._writable()
        self._writer.drain()
        with env.begin(write=True) as txn:
            number = int(txn.get(b"seal", db=self._meta)) + 1
            txn.drop(self._dirty, delete=False)
            txn.cursor(db=self._dirty).putmulti((key, b"") for key in _keys(dirty))
            txn.put(b"seal", str(number).encode(), db=self._meta)
            txn.put(b"boot", _boot_id(), db=self._meta)
        env.sync(True)
        return number

    def reopen(self, name: str, seal: int) -> str | None:
        """Adopts the store ``name`` an earlier run left under this place, if its seal is ``seal`` and this
        machine has not restarted since it was written; returns None, or why not (then nothing changed)."""
        path = self._parent / name
        if self._env is not None:
            return f"this table has written its own store {self.name!r} already"
        if not name.startswith("rows-") or not (path / "data.mdb").is_file():
            return f"no store {name!r} under {str(self._parent)!r}"
        try:
            env = self._lmdb.open(str(path), map_size=_MAP_SIZE, sync=False, metasync=False, readahead=False,
                                  max_dbs=3, create=False)
        except self._lmdb.Error as exc:
            return f"store {str(path)!r} does not open ({exc})"
        try:
            with env.begin() as txn:
                meta = env.open_db(b"meta", txn=txn, create=False)
                found = (txn.get(b"seal", db=meta), txn.get(b"boot", db=meta), txn.get(b"format", db=meta))
        except self._lmdb.Error as exc:
            env.close()
            return f"store {str(path)!r} has no seal ({exc})"
        env.close()
        if found[2] != _FORMAT:
            written = "1" if found[2] is None else found[2].decode(errors="replace")
            return (f"store {str(path)!r} has its rows in format {written}, this version of unison reads format "
                    f"{_FORMAT.decode()}")
        if found[0] is None or int(found[0]) != seal:
            return f"store {str(path)!r} is at seal {found[0] and int(found[0])}, the checkpoint at seal {seal}"
        if found[1] != _boot_id() or not found[1]:
            return (f"store {str(path)!r} was written before this machine restarted (its writes after the seal "
                    f"were not flushed)")
        self._open(path, create=False)
        return None

    def dirty(self) -> torch.Tensor:
        """The ids written or deleted since the last seal, ascending."""
        if self._env is None:
            return torch.zeros(0, dtype=torch.int64)
        self._writer.drain()
        with self._env.begin() as txn:
            raw = b"".join(txn.cursor(db=self._dirty).iternext(keys=True, values=False))
        return _ids(raw)

    def __len__(self) -> int:
        """Values stored."""
        if self._env is None:
            return 0
        self._writer.drain()
        with self._env.begin() as txn:
            return int(txn.stat(self._rows)["entries"])

    @property
    def disk_bytes(self) -> int:
        """Bytes the store's files take on disk (allocated blocks)."""
        if self._env is None:
            return 0
        self._writer.drain()
        return sum(f.stat().st_blocks * 512 for f in self.directory.iterdir() if f.is_file())

    def close(self, remove: bool = True) -> None:
        """Closes the store and (``remove``) removes its files (they hold nothing a checkpoint does not)."""
        self._shut_down()  # the writes queued are applied first
        if self._env is not None:
            self._env.close()
            self._env = None
        if remove:
            shutil.rmtree(self.directory, ignore_errors=True)


@final
class _Destination:
    """Where a store's writes go: its directory (a resume replaces it) and its writer process.

    What the writer thread holds instead of the store: held by the thread while it writes,
    the store itself outlived its last reference until that write ended, so a table let go
    left its process running after the drop (a loaded machine's leak check saw it).
    """

    def __init__(self, directory: Path, process: WriterProcess) -> None:
        self.directory, self.process = directory, process

    def __call__(self, keys: torch.Tensor, values: torch.Tensor | None, mark: torch.Tensor) -> None:
        """One batch, applied by the writer process (called on the writer thread)."""
        data = None if values is None else np.ascontiguousarray(values.numpy()).data.cast("B")
        width = 0 if values is None else int(values.shape[1])
        self.process.write(self.directory, _row_keys(keys), data, width, mark.numpy().astype(">i8").data.cast("B"))


def _shut_down(writer: RowWriter, process: WriterProcess) -> None:
    """Applies the writes queued, then ends the writer thread and the writer process."""
    writer.close()
    process.close()


def _boot_id() -> bytes:
    """This boot of the machine (Linux), or b"" where it cannot be told."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_bytes().strip()
    except OSError:
        return b""


def _row_keys(ids: torch.Tensor) -> memoryview:
    """The rows' keys: each id's 8 bytes in this machine's order, which the rows database compares as
    integers (``MDB_INTEGERKEY``: a word compare per key in the B-tree's descent, not a byte compare)."""
    return np.ascontiguousarray(ids.numpy(), dtype=np.int64).data.cast("B")


def _split(raw: memoryview) -> list[bytes]:
    data = raw.tobytes()
    return [data[i:i + 8] for i in range(0, len(data), 8)]


def _keys(ids: torch.Tensor) -> list[bytes]:
    raw = ids.numpy().astype(">i8").tobytes()
    return [raw[i:i + 8] for i in range(0, len(raw), 8)]


def _ids(raw: bytes) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(raw, dtype=">i8").astype(np.int64)).sort().values


