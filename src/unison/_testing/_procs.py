"""The parent side of the harness: start, watch, interrupt and reap worker processes.

Shared by :func:`~unison._testing.workers.run_workers` (fresh processes per call) and
:class:`~unison._testing.pool.WorkerPool` (long-lived members).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from multiprocessing import forkserver, get_context
from multiprocessing.connection import Connection, wait
from typing import Any

import cloudpickle

__all__ = [
    "BASE_CHILD_ENV",
    "ChildProcess",
    "spawn_children",
    "worker_context",
    "pump",
    "wait_until",
    "dump_stacks",
    "reap",
    "relay_stderr",
]

BASE_CHILD_ENV: Mapping[str, str] = {
    "GLOO_SOCKET_IFNAME": "lo",
    "OMP_NUM_THREADS": "1",
    "MASTER_ADDR": "127.0.0.1",
}
"""Environment every worker starts with (``env`` arguments override it)."""

# Upper bound on waiting for faulthandler's output after SIGUSR1.
_STACK_DUMP_WAIT_S = 2.0
# Output is complete once a dump file has not grown for this long.
_STACK_DUMP_QUIET_S = 0.15
# Upper bound on joining a process after SIGKILL.
_JOIN_AFTER_KILL_S = 10.0

_environ_lock = threading.Lock()


@contextmanager
def _child_environment(overrides: Mapping[str, str | None]) -> Iterator[None]:
    """Applies ``overrides`` to ``os.environ`` while children are being started.

    Neither start method offers an ``env`` argument. A spawned child execs with this
    process's environment; a child forked from the fork server is handed the same
    mapping and adopts it first thing (``_child.start``). Variables read when the
    interpreter or a library starts, like ``OMP_NUM_THREADS``, are then the server's:
    it starts under ``BASE_CHILD_ENV`` (and each worker sets one torch thread anyway).
    A value of None removes the variable.
    """
    with _environ_lock:
        saved = {key: os.environ.get(key) for key in overrides}
        try:
            for key, value in overrides.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            yield
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


class ChildProcess:
    """Parent-side handle of one worker process and its pipe.

    Attributes:
        rank: The worker's rank.
        process: The ``multiprocessing`` process.
        conn: The parent's end of the pipe; None once it reached end of file.
        stderr_path: File the child's stderr is redirected to.
        ready: The child has installed its SIGUSR1 stack dump handler.
        outcome: ``("ok", value)`` or ``("error", text)`` of the current call, or None.
        group_lost: The child reported that its process group was destroyed.
    """

    def __init__(self, rank: int, process: Any, conn: Connection, stderr_path: str) -> None:
        self.rank = rank
        self.process = process
        self.pid: int = process.pid
        self.conn: Connection | None = conn
        self.stderr_path = stderr_path
        self.ready = False
        self.outcome: tuple[str, Any] | None = None
        self.group_lost = False
        self._exitcode: int | None = None
        self._closed = False

    @property
    def exitcode(self) -> int | None:
        """The exit status, or None while the process runs (reaps it if it ended)."""
        if self._exitcode is None and not self._closed:
            self._exitcode = self.process.exitcode
        return self._exitcode

    @property
    def failed(self) -> bool:
        """The current call failed: ``fn`` raised, or the process ended badly."""
        if self.outcome is not None and self.outcome[0] != "ok":
            return True
        code = self.exitcode
        return code is not None and (code != 0 or self.outcome is None)

    def receive(self) -> None:
        """Reads one message; closes the pipe at end of file."""
        assert self.conn is not None
        try:
            data = self.conn.recv_bytes()
        except (EOFError, OSError):
            self.conn.close()
            self.conn = None
            return
        try:
            kind, payload = cloudpickle.loads(data)
        except Exception as exc:
            kind, payload = "error", f"rank {self.rank}: its result could not be unpickled: {exc!r}"
        if kind == "ready":
            self.ready = True
        elif kind == "group-lost":
            self.group_lost = True
        else:
            self.outcome = (kind, payload)

    def drain(self) -> None:
        """Reads what an exited child left in the pipe, then closes it."""
        while self.conn is not None and self.conn.poll(0):
            self.receive()
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def stderr_size(self) -> int:
        """Current size of the captured stderr file."""
        try:
            return os.path.getsize(self.stderr_path)
        except OSError:
            return 0

    def read_stderr(self, start: int = 0, end: int | None = None) -> str:
        """The captured stderr from byte ``start`` to ``end`` (default: the end)."""
        try:
            with open(self.stderr_path, "rb") as f:
                f.seek(start)
                data = f.read() if end is None else f.read(max(0, end - start))
        except OSError:
            return ""
        return data.decode("utf-8", errors="replace")


_PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "cloudpickle", "unison._testing._eager_api",
            "unison._testing._child")
"""What the fork server imports once, so that a worker starts without importing torch. Dynamo too:
a torch optimizer's constructor imports it (2-3 s on the 2-core VM), and nearly every worker builds
one (the embedding tables, which imported it at import until issue 45, no longer do)."""
_start_method_lock = threading.Lock()


def worker_context() -> Any:
    """The start method for workers: a fork server that has imported torch, where Linux
    can watch the test process through a pidfd; ``spawn`` elsewhere.

    A spawned worker imports torch again (most of a small multi-process test:
    ``benchmarks/RESULTS.md``, 'Test worker start and exit'); one forked from the server
    starts in milliseconds. The server itself is a fresh interpreter that only imported
    modules, so workers are as clean as spawned ones: no threads, no process group, the
    environment and ``sys.path`` of the test at the time of the call (see
    ``_child.start``).
    """
    if "forkserver" not in multiprocessing.get_all_start_methods() or not hasattr(os, "pidfd_open"):
        return get_context("spawn")
    ctx = get_context("forkserver")
    with _start_method_lock:
        ctx.set_forkserver_preload(list(_PRELOAD))
        with _child_environment(BASE_CHILD_ENV):  # the server's own environment: no test's overrides
            forkserver.ensure_running()
    return ctx


def spawn_children(
    target: Callable[..., None],
    world_size: int,
    extra_args: Sequence[Any],
    env: Mapping[str, str | None],
    tmpdir: str,
    *,
    duplex: bool,
) -> list[ChildProcess]:
    """Starts ``world_size`` spawned processes running ``target``.

    Each runs ``target(rank, world_size, conn, stderr_path, *extra_args)``.

    Args:
        target: Module-level function of :mod:`unison._testing._child`.
        world_size: Number of processes.
        extra_args: Further arguments, picklable with the standard pickler.
        env: Overrides of this process's environment for the children.
        tmpdir: Directory for the children's stderr files.
        duplex: Whether the parent also sends messages to the children.

    Returns:
        One handle per rank. If any start fails, those already started are reaped.
    """
    from unison._testing import _child

    ctx = worker_context()
    children: list[ChildProcess] = []
    try:
        with _child_environment(env):
            environ = dict(os.environ)  # what a spawned child would start with
            for rank in range(world_size):
                # Pipe(duplex=False) returns (reader, writer): the parent reads.
                parent_conn, child_conn = ctx.Pipe(duplex=duplex)
                stderr_path = os.path.join(tmpdir, f"rank{rank}.stderr")
                open(stderr_path, "wb").close()
                process = ctx.Process(
                    target=_child.start,
                    args=(environ, os.getpid(), target, rank, world_size, child_conn, stderr_path, *extra_args),
                    name=f"unison-worker-{rank}",
                )
                process.start()
                child_conn.close()
                children.append(ChildProcess(rank, process, parent_conn, stderr_path))
    except BaseException:
        reap(children)
        raise
    return children


def pump(children: Sequence[ChildProcess], until: float) -> bool | None:
    """Waits for the next events from the children and handles them.

    Args:
        children: The processes to watch.
        until: ``time.monotonic()`` deadline.

    Returns:
        True when something was handled, False when the deadline passed first, None
        when there is nothing left to wait for (every child exited and was drained).
    """
    waitables: dict[Any, tuple[ChildProcess, bool]] = {}
    for child in children:
        if child.exitcode is not None:
            # Exited: what it wrote is in the pipe already. Do not wait for end of
            # file, which a process it started could hold off.
            child.drain()
        if child.conn is not None:
            waitables[child.conn] = (child, True)
        if child.exitcode is None:
            waitables[child.process.sentinel] = (child, False)
    if not waitables:
        return None
    remaining = until - time.monotonic()
    if remaining <= 0:
        return False
    ready = wait(list(waitables), timeout=remaining)
    for obj in ready:
        child, is_conn = waitables[obj]
        if is_conn:
            if child.conn is not None:
                child.receive()
        else:
            child.process.join(0)
            child.drain()
    return bool(ready)


def wait_until(
    children: Sequence[ChildProcess],
    finished: Callable[[], bool],
    deadline: float,
    grace: float | None = None,
) -> str:
    """Handles the children's events until ``finished()`` or a time limit.

    Args:
        children: The processes to watch.
        finished: Condition on the children's state.
        deadline: ``time.monotonic()`` time limit.
        grace: If given: once a child has failed, the limit shrinks to ``grace``
            seconds later, so the others need not run into ``deadline``.

    Returns:
        ``"done"`` when ``finished()`` held; ``"timeout"`` when ``deadline`` passed;
        ``"stopped"`` when the grace after a failure ran out first; ``"exited"`` when
        every child exited without ``finished()`` holding.
    """
    stop = deadline
    while not finished():
        if grace is not None and stop == deadline and any(c.failed for c in children):
            stop = min(deadline, time.monotonic() + grace)
        handled = pump(children, stop)
        if handled is None:
            return "done" if finished() else "exited"
        if not handled and time.monotonic() >= stop:
            if finished():
                break
            return "timeout" if stop >= deadline else "stopped"
    return "done"


def dump_stacks(children: Sequence[ChildProcess]) -> dict[int, str]:
    """Asks every live child for a stack dump (SIGUSR1) and collects it.

    Args:
        children: The processes; those not running are skipped.

    Returns:
        Rank -> faulthandler's dump of all its threads, or a note saying why there is
        none (the child had not finished starting up).
    """
    live = [c for c in children if c.exitcode is None]
    offsets = {c.rank: c.stderr_size() for c in live}
    signalled = []
    for child in live:
        if not child.ready:
            continue  # SIGUSR1 would kill it before faulthandler is installed.
        try:
            os.kill(child.pid, signal.SIGUSR1)
        except ProcessLookupError:
            continue
        signalled.append(child)
    _wait_for_dumps(signalled, offsets)
    stacks = {}
    for child in live:
        if child in signalled:
            stacks[child.rank] = _without_watchdog(child.read_stderr(offsets[child.rank]))
        else:
            stacks[child.rank] = "(no stack: the process had not finished starting up)"
    return stacks


def _without_watchdog(dump: str) -> str:
    """Drops the harness's own parent-watching thread from a faulthandler dump."""
    blocks = dump.strip().split("\n\n")
    kept = [b for b in blocks if "in watch_parent" not in b or "_child.py" not in b]
    return "\n\n".join(kept)


def _wait_for_dumps(children: Sequence[ChildProcess], offsets: Mapping[int, int]) -> None:
    """Waits until each child's dump has been written (its file stopped growing)."""
    deadline = time.monotonic() + _STACK_DUMP_WAIT_S
    sizes = {c.rank: offsets[c.rank] for c in children}
    quiet_since = time.monotonic()
    while children and time.monotonic() < deadline:
        # faulthandler writes from a signal handler: there is no event to wait on,
        # so watch the files, waking early if a process exits.
        wait([c.process.sentinel for c in children], timeout=_STACK_DUMP_QUIET_S / 3)
        now = time.monotonic()
        current = {c.rank: c.stderr_size() for c in children}
        if current != sizes:
            sizes, quiet_since = current, now
        grown = all(current[r] > offsets[r] for r in current)
        if grown and now - quiet_since >= _STACK_DUMP_QUIET_S:
            return


def _kill_group(child: ChildProcess) -> None:
    """SIGKILLs the child's process group (the child and anything it started)."""
    try:
        if child.ready:  # The child has made itself a group leader by now.
            os.killpg(child.pid, signal.SIGKILL)
        elif child.exitcode is None:
            child.process.kill()
    except (ProcessLookupError, PermissionError):
        pass


def reap(children: Sequence[ChildProcess]) -> None:
    """Kills whatever still runs, joins every process and closes every pipe.

    Exit codes stay readable on the handles; each handle may be reaped once.
    """
    live = [c for c in children if not c._closed]
    for child in live:
        _kill_group(child)
    for child in live:
        child.process.join(_JOIN_AFTER_KILL_S)
        child.drain()
        if child.exitcode is not None:
            child.process.close()
            child._closed = True


def relay_stderr(
    children: Sequence[ChildProcess],
    start: Mapping[int, int],
    end: Mapping[int, int] | None = None,
) -> dict[int, str]:
    """Copies what each child wrote to stderr to this process's stderr.

    pytest then shows it under "Captured stderr" of the test.

    Args:
        children: The processes.
        start: Rank -> byte offset to copy from (default 0).
        end: Rank -> byte offset to stop at (default: the end), e.g. where a stack
            dump that is reported elsewhere begins.

    Returns:
        Rank -> the text copied.
    """
    texts = {}
    for child in children:
        stop = None if end is None else end.get(child.rank)
        text = child.read_stderr(start.get(child.rank, 0), stop)
        texts[child.rank] = text
        if text.strip():
            sys.stderr.write(f"----- unison worker rank {child.rank} stderr -----\n{text}")
            if not text.endswith("\n"):
                sys.stderr.write("\n")
    sys.stderr.flush()
    return texts
