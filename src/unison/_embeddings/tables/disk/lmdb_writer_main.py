"""The disk tier's writer process: applies a store's write batches to its LMDB files.

Run by path (``python lmdb_writer_main.py DIRECTORY MAP_SIZE``), never imported: it needs only
``lmdb``, so it starts in tens of milliseconds without torch or unison. ``writer_process``
starts it and speaks to it over its standard input and output. Each request is a frame (an
8-byte little-endian length, then the payload): a 32-byte header ``(rows, width, marks,
delete)`` of little-endian int64, the rows' keys (8 bytes each, the rows database's integer
keys), their values (``width`` bytes each, none for a delete) and the ids to record as dirty
(8 bytes each, big-endian). The answer is ``b"k"`` once the batch is committed, or ``b"e"``
and a frame with the error. An empty frame, or the end of the input (its parent ended), ends it.

A batch commits in transactions of at most 1,024 rows, the first with every dirty mark (so a
crash never leaves a row written whose id is not marked). After answering, the process hands
its memory back: LMDB keeps the page buffers of its largest transaction for reuse, and the
pages its writes read through the map stayed mapped (a writer that had filled a 1M-row store
in one transaction a batch held 56 MB; now 16-18 MB, most of it the interpreter's).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import struct
import sys
from collections.abc import Callable
from typing import BinaryIO

_HEADER = struct.Struct("<qqqq")
_LENGTH = struct.Struct("<q")
_ROWS_PER_TRANSACTION = 1024
_MADV_DONTNEED = 4  # Linux


def _read_exactly(stream: BinaryIO, count: int) -> bytes | None:
    data = stream.read(count)
    return data if data is not None and len(data) == count else None


def _frame(payload: bytes) -> bytes:
    return _LENGTH.pack(len(payload)) + payload


def serve(directory: str, map_size: int, requests: BinaryIO, answers: BinaryIO) -> None:
    """Applies each request of ``requests`` to the store in ``directory`` and answers on ``answers``."""
    import lmdb

    env = lmdb.open(directory, map_size=map_size, sync=False, metasync=False, readahead=False, max_dbs=3,
                    create=False)
    rows, dirty = env.open_db(b"rows", integerkey=True), env.open_db(b"dirty")
    data_file = os.path.join(os.path.realpath(directory), "data.mdb")
    try:
        while True:
            head = _read_exactly(requests, _LENGTH.size)
            if head is None:
                return
            length = _LENGTH.unpack(head)[0]
            payload = _read_exactly(requests, length) if length else None
            if payload is None:
                return
            try:
                _apply(env, rows, dirty, memoryview(payload))
            except Exception as exc:  # answered, not raised: the parent names the store and stops using it
                answers.write(b"e" + _frame(f"{type(exc).__name__}: {exc}".encode()))
            else:
                answers.write(b"k")
            answers.flush()
            del payload
            trim()  # the transactions' page copies beyond what LMDB keeps for reuse, freed at their commits
            unmap(data_file)  # the file's pages the writes read (they stay in the page cache)
    finally:
        env.close()


def _heap_trimmer() -> Callable[[], object]:
    """glibc's ``malloc_trim(0)``: LMDB mallocs a copy of each page a transaction changes, and glibc keeps
    the freed copies in the heap unless asked; a no-op where there is no glibc."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name is not None else None
    except (OSError, AttributeError):
        trim = None
    if trim is None:
        return lambda: None
    trim.argtypes = [ctypes.c_size_t]
    return lambda: trim(0)


trim = _heap_trimmer()


def _page_unmapper() -> Callable[[str], object]:
    """Drops this process's mappings of the store's pages (``madvise(MADV_DONTNEED)`` over LMDB's read-only
    shared map; Linux): a write reads the pages on its B-tree paths through the map, and each stayed
    resident in this process (107 MB after filling a 1M-row store in 1,024-row transactions), though
    they are the page cache's, shared and clean. The next write maps the ones it needs again."""
    name = ctypes.util.find_library("c")
    try:
        madvise = ctypes.CDLL(name).madvise if name is not None and sys.platform.startswith("linux") else None
    except (OSError, AttributeError):
        madvise = None
    if madvise is None:
        return lambda data_file: None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

    def unmap(data_file: str) -> None:
        try:
            with open("/proc/self/maps") as maps:
                lines = [line for line in maps if line.rstrip().endswith(data_file)]
        except OSError:  # no /proc: the pages stay mapped
            return
        for line in lines:  # "start-end perms offset dev inode path"
            start, end = (int(bound, 16) for bound in line.split(maxsplit=1)[0].split("-"))
            madvise(start, end - start, _MADV_DONTNEED)

    return unmap


unmap = _page_unmapper()


def _apply(env: object, rows: object, dirty: object, payload: memoryview) -> None:
    """One request, in transactions of at most ``_ROWS_PER_TRANSACTION`` rows, the first also recording
    every id to mark dirty: a crash leaves no row written whose id is not marked (a resume rolls marked
    rows back to the checkpoint), and LMDB, which keeps the page buffers of its largest transaction for
    reuse, keeps a few megabytes, not one buffer per page a spill of thousands of rows dirtied."""
    count, width, marks, delete = _HEADER.unpack(payload[:_HEADER.size])
    at = _HEADER.size
    keys = payload[at:at + 8 * count]
    at += 8 * count
    values = payload[at:at + (0 if delete else width * count)]
    at += len(values)
    marked = payload[at:at + 8 * marks]
    for start in range(0, max(count, 1), _ROWS_PER_TRANSACTION):
        end = min(count, start + _ROWS_PER_TRANSACTION)
        with env.begin(write=True) as txn:  # type: ignore[attr-defined]
            if start == 0 and marks:
                txn.cursor(db=dirty).putmulti((marked[8 * i:8 * i + 8], b"") for i in range(marks))
            if delete:
                for i in range(start, end):
                    txn.delete(keys[8 * i:8 * i + 8], db=rows)
            else:
                txn.cursor(db=rows).putmulti((keys[8 * i:8 * i + 8], values[width * i:width * i + width])
                                             for i in range(start, end))


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]), sys.stdin.buffer, sys.stdout.buffer)
