"""``WriterProcess``: a store's write batches applied by a process of its own, which shares no GIL with training.

py-lmdb releases the GIL around every put and takes it back after, so a writer *thread*
and the training thread handed the GIL to each other at every put and at every torch op of
the step: the steps a spill's writes ran beside took 20.3 ms against 16.0 ms for the others
(``benchmarks/disk_tier.py``, 8,192 ids a step; ``benchmarks/RESULTS.md``). Here the writer
thread (``row_writer``, which keeps the order and the rows in flight) hands each batch to a
child process, ``lmdb_writer_main.py`` run by path (only ``lmdb`` imported: it starts in tens
of milliseconds), through a pipe, and waits for its answer without the GIL; the child opens
the same files (LMDB serialises writers across processes, and the parent's readers see each
commit), applies the batch in one transaction and answers. LMDB's page copies of a write
transaction live in the child too, so they no longer stay in the parent's heap.

The child ends when its input closes: at :meth:`WriterProcess.close`, or when its parent
dies (a killed ps task leaves no writer behind). A child that failed or ended makes the
write raise, and ``row_writer`` reports it, naming the store, at the next step.
"""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path
from typing import IO, final

__all__ = ["WriterProcess"]

_SCRIPT = Path(__file__).with_name("lmdb_writer_main.py")
_HEADER = struct.Struct("<qqqq")  # as lmdb_writer_main reads it
_LENGTH = struct.Struct("<q")
_CLOSE_SECONDS = 30.0


@final
class WriterProcess:
    """The child process that writes one store (started at its first write, for that store's directory).

    Not thread-safe: one thread (the store's writer thread) writes through it.
    """

    def __init__(self, map_size: int) -> None:
        self._map_size = map_size
        self._child: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        """The child's process id, or None before the first write and after :meth:`close`."""
        return None if self._child is None else self._child.pid

    def write(self, directory: Path, keys: memoryview, values: memoryview | None, width: int,
              marks: memoryview) -> None:
        """Applies one batch to the store in ``directory``: ``values`` (``width`` bytes a row; None: delete the
        keys) under ``keys`` (8 bytes each), and ``marks`` (8 bytes each) recorded as dirty, in transactions
        of at most 1,024 rows, the marks in the first (``lmdb_writer_main``); returns once all are committed.

        Raises:
            RuntimeError: what the child raised, or that it ended (with its exit code).
        """
        child = self._started(directory)
        count = len(keys) // 8
        payload = [_HEADER.pack(count, width, len(marks) // 8, values is None), keys,
                   *(() if values is None else (values,)), marks]
        stdin, stdout = _pipes(child)
        try:
            stdin.write(_LENGTH.pack(sum(len(part) for part in payload)))
            for part in payload:
                stdin.write(part)
            stdin.flush()
            answer = stdout.read(1)
            if answer == b"k":
                return
            if answer == b"e":
                length = _LENGTH.unpack(stdout.read(_LENGTH.size))[0]
                raise RuntimeError(stdout.read(length).decode(errors="replace"))
        except (BrokenPipeError, OSError, struct.error):
            pass  # ended while we spoke: said below
        try:
            code: int | None = child.wait(1.0)  # its pipes closed: it is ending, if not gone
        except subprocess.TimeoutExpired:
            code = None
        raise RuntimeError(f"the disk writer process {child.pid} ended"
                           + (f" (exit code {code})" if code is not None else ""))

    def close(self) -> None:
        """Ends the child once it has applied what it was sent (it reads the end of its input)."""
        child, self._child = self._child, None
        if child is None:
            return
        stdin, stdout = _pipes(child)
        try:
            stdin.close()
        except OSError:
            pass
        try:
            child.wait(_CLOSE_SECONDS)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        stdout.close()

    def _started(self, directory: Path) -> subprocess.Popen[bytes]:
        if self._child is None:
            self._child = subprocess.Popen([sys.executable, str(_SCRIPT), str(directory), str(self._map_size)],
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True)
        return self._child


def _pipes(child: subprocess.Popen[bytes]) -> tuple[IO[bytes], IO[bytes]]:
    assert child.stdin is not None and child.stdout is not None, "started with both pipes"
    return child.stdin, child.stdout
