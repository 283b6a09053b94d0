"""``RowWriter``: a disk store's writes applied by a background thread, in order, the rows in flight readable.

A step's spill (and an eviction's deletes) used to run inside the push that ends the step:
LMDB's copy-on-write B-tree costs tens of microseconds a row written, so the step waited for
the disk (``benchmarks/disk_tier.py`` under ``py-spy``). Here the store hands each batch to
one writer thread and returns, so a step does not wait for its own spill. The thread only
hands each batch to the store's writer process and waits for it without the GIL
(``writer_process``: py-lmdb takes the GIL back after every put, so writes on a thread of this
process cost the training thread about as much as they saved it). Order is kept (one thread, a
FIFO queue), a batch's dirty marks are committed with its first rows (a crash never leaves a
row written whose id is not marked dirty), and a row whose batch is not committed yet is
read from the batch itself (:meth:`overlay`), never from an older copy on disk. At most
``depth`` batches wait: a step that spills faster than the disk writes waits for it then
(the rows in flight are memory beyond the budget: at most ``depth`` spill batches).

A failed write is kept and raised, naming the store, by the next call of the thread that
submits (the store is then unusable: reload the checkpoint).
"""

from __future__ import annotations

import collections
import queue
import threading
from collections.abc import Callable
from typing import final

import torch

__all__ = ["RowWriter"]

_DEPTH = 4

Write = Callable[[torch.Tensor, "torch.Tensor | None", torch.Tensor], None]


@final
class RowWriter:
    """Applies batches ``(keys, values or None for a delete, ids to mark dirty)`` with ``write`` on a thread.

    Args:
        write: applies one batch, returning once it is committed (called on the writer thread, which
            holds it: it must not hold the store, or a store let go lives on while it writes).
        where: the store's directory, for error messages.
        depth: batches that may wait before a submit blocks.
    """

    def __init__(self, write: Write, where: str, depth: int = _DEPTH) -> None:
        self._write = write
        self._where = where
        self._queue: queue.Queue[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor] | None] = queue.Queue(depth)
        self._pending: collections.deque[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = collections.deque()
        self._lock = threading.Lock()
        self._failure: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._stop = False  # set on the thread itself: it ends once the queue is empty

    def submit(self, keys: torch.Tensor, values: torch.Tensor | None, mark: torch.Tensor) -> None:
        """Queues a put (``values``: ``[n, width]`` uint8, not changed afterwards) or a delete (None)."""
        self._raise_failure()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"unison-disk-writer {self._where}", daemon=True)
            self._thread.start()
        if values is not None:
            ordered, order = keys.sort()
            with self._lock:
                self._pending.append((ordered, order, values))
        self._queue.put((keys, values, mark))

    def overlay(self, keys: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Fills ``out[i]`` with the newest value in flight for ``keys[i]``; returns which were found."""
        with self._lock:
            pending = list(self._pending)  # before any disk read: a batch leaves only once committed
        found = torch.zeros(keys.numel(), dtype=torch.bool)
        for ordered, order, values in reversed(pending):
            wanted = (~found).nonzero().squeeze(1)
            if not wanted.numel():
                break
            at = torch.searchsorted(ordered, keys.index_select(0, wanted)).clamp(max=ordered.numel() - 1)
            hit = ordered.index_select(0, at) == keys.index_select(0, wanted)
            rows = wanted[hit]
            out.index_copy_(0, rows, values.index_select(0, order.index_select(0, at[hit])))
            found[rows] = True
        return found

    def drain(self) -> None:
        """Waits until every queued batch is written; raises a failed write."""
        if self._thread is not None:
            self._queue.join()
        self._raise_failure()

    def close(self) -> None:
        """Writes what is queued, then ends the thread (called on the thread itself, it only asks it to end)."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        if thread is threading.current_thread():  # the store collected by a collection on this thread
            self._stop = True
            return
        self._queue.put(None)
        thread.join()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                keys, values, mark = item
                if self._failure is None:
                    self._write(keys, values, mark)
            except BaseException as exc:  # kept for the submitting thread, which raises it
                self._failure = exc
            finally:
                if item is not None and item[1] is not None:
                    with self._lock:
                        self._pending.popleft()
                self._queue.task_done()
            if self._stop and self._queue.empty():
                return

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise RuntimeError(f"DiskStorage: writing rows to {self._where!r} failed: {self._failure}; the store "
                               f"is unusable now, fix: free disk space (or the path's cause), then load the last "
                               f"checkpoint") from self._failure
