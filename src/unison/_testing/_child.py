"""The child side of the harness: what runs inside each worker process.

A child talks to the parent over one ``multiprocessing`` pipe. Every message is a
cloudpickled ``(kind, payload)`` tuple:

* ``("ready", pid)``: stderr is captured and the stack-dump handler is installed, so
  the parent may send SIGUSR1 from now on;
* ``("ok", value)`` / ``("error", traceback_text)``: the outcome of one call of ``fn``;
* ``("group-lost", None)``: a pool member's process group was destroyed by ``fn``.
"""

from __future__ import annotations

import atexit
import faulthandler
import multiprocessing
import os
import select
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import cloudpickle

__all__ = ["WATCHDOG_THREAD", "start", "worker_main", "pool_member_main"]

WATCHDOG_THREAD = "unison-testing-watch-parent"
"""Name of the worker's thread that ends it when the test process dies."""

# Exit status of a child that outlived its parent (the test process died).
_ORPHAN_EXIT = 70
# Exit status of a child whose fn succeeded but whose process-group teardown failed.
_TEARDOWN_EXIT = 3

Outcome = tuple[str, Any]


_parent_pid: int | None = None  # the test process, which this worker must not outlive


def start(environ: dict[str, str], parent_pid: int, target: Callable[..., None], *args: Any) -> None:
    """Entry point of every worker: takes the test's environment (a worker forked from the
    fork server starts with the server's) and the test process's pid, then runs ``target``."""
    global _parent_pid
    _parent_pid = parent_pid
    if os.environ != environ:
        os.environ.clear()
        os.environ.update(environ)
    target(*args)


def _prepare_process(stderr_path: str) -> None:
    """Captures stderr, installs stack dumps and a parent watchdog, pins threads."""
    # A group of its own, so the parent can kill whatever this worker starts too.
    os.setpgid(0, 0)
    sys.stderr.flush()
    fd = os.open(stderr_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.dup2(fd, 2)
    os.close(fd)
    faulthandler.enable(file=sys.stderr, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True, chain=False)
    _exit_with_parent()
    import torch

    torch.set_num_threads(1)


def _exit_with_parent() -> None:
    """Ends this process when the test process dies, so no worker is orphaned."""
    if _parent_pid is None:
        return
    try:
        # A pidfd becomes readable when the process ends. Not the multiprocessing parent
        # sentinel: a worker forked by the fork server reads its start data from a pipe
        # the test process closes at once. A thread rather than prctl(PR_SET_PDEATHSIG):
        # that fires when the *thread* that started the worker ends, which is too early
        # for a pool started from a helper thread.
        ended = os.pidfd_open(_parent_pid)  # readable once the test process is gone
    except ProcessLookupError:
        os._exit(_ORPHAN_EXIT)
    except (AttributeError, OSError):  # no pidfd here (spawned): the spawn pipe's sentinel
        parent = multiprocessing.parent_process()
        if parent is None:
            return
        ended = parent.sentinel

    def watch_parent() -> None:
        select.select([ended], [], [])
        os._exit(_ORPHAN_EXIT)

    threading.Thread(target=watch_parent, name=WATCHDOG_THREAD, daemon=True).start()


def _send(conn: Connection, kind: str, payload: Any = None) -> None:
    conn.send_bytes(cloudpickle.dumps((kind, payload)))


def _current_traceback(rank: int) -> str:
    return f"rank {rank} raised:\n{traceback.format_exc()}"


def _call(job: bytes, rank: int, world_size: int) -> Outcome:
    """Unpickles ``(fn, args)`` and runs ``fn(rank, world_size, *args)``."""
    try:
        fn, args = cloudpickle.loads(job)
        return "ok", fn(rank, world_size, *args)
    except BaseException:  # SystemExit and KeyboardInterrupt must reach the test too.
        return "error", _current_traceback(rank)


def _send_outcome(conn: Connection, rank: int, outcome: Outcome) -> bool:
    """Sends an outcome; returns whether it was a success that could be pickled."""
    kind, payload = outcome
    try:
        data = cloudpickle.dumps(outcome)
    except Exception:
        kind = "error"
        data = cloudpickle.dumps(
            (kind, f"rank {rank}: its return value of type {type(payload).__qualname__} "
                   f"could not be pickled:\n{traceback.format_exc()}")
        )
    conn.send_bytes(data)
    return kind == "ok"


def _destroy_default_group() -> bool:
    """Destroys a default process group left initialised; returns False on failure."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return True
    try:
        dist.destroy_process_group()
    except Exception:
        traceback.print_exc()
        return False
    return True


def _exit(code: int) -> None:
    """Ends the process as a normal exit would, minus the final garbage collection.

    Interpreter finalisation with torch loaded takes seconds on a busy machine, once per
    worker (``benchmarks/RESULTS.md``, 'Test worker start and exit'). Everything else a
    normal exit does is kept: non-daemon threads are joined (a hang here shows in the
    parent's stack dump) and atexit handlers run.
    """
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def worker_main(
    rank: int, world_size: int, conn: Connection, stderr_path: str, job: bytes
) -> None:
    """Runs one call of ``fn`` in a fresh process started by ``run_workers``."""
    _prepare_process(stderr_path)
    _send(conn, "ready", os.getpid())
    ok = _send_outcome(conn, rank, _call(job, rank, world_size))
    conn.close()
    code = 0 if ok else 1
    if not _destroy_default_group() and ok:
        code = _TEARDOWN_EXIT
    _exit(code)


def pool_member_main(
    rank: int,
    world_size: int,
    conn: Connection,
    stderr_path: str,
    form_group: Callable[[int, int], None],
) -> None:
    """Serves calls of ``fn`` in a long-lived ``WorkerPool`` member.

    The member forms its process group once with ``form_group(rank, world_size)``
    and answers ``("ok", None)`` (or the traceback of forming it), then runs each job
    the parent sends until it receives an empty message. It restores ``os.environ``
    after every job, so one test's settings do not reach the next.
    """
    _prepare_process(stderr_path)
    _send(conn, "ready", os.getpid())
    import torch.distributed as dist

    try:
        form_group(rank, world_size)
    except BaseException:
        _send(conn, "error", _current_traceback(rank))
        _exit(1)
    _send(conn, "ok", None)
    while True:
        try:
            job = conn.recv_bytes()
        except (EOFError, OSError):
            break
        if not job:
            break
        environ = dict(os.environ)
        outcome = _call(job, rank, world_size)
        if not dist.is_initialized():
            _send(conn, "group-lost")
        _send_outcome(conn, rank, outcome)
        if os.environ != environ:
            os.environ.clear()
            os.environ.update(environ)
    conn.close()
    _exit(0 if _destroy_default_group() else _TEARDOWN_EXIT)
