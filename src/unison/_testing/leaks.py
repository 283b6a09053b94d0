"""Find threads and child processes a test left behind.

Used by the autouse fixture in ``tests/conftest.py``: a snapshot before the test, a
check after it. Both are cheap (one ``/proc`` scan, about a millisecond), because they
run around every test.
"""

from __future__ import annotations

import dataclasses
import gc
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterable
from multiprocessing import forkserver, resource_tracker

__all__ = ["Snapshot", "snapshot", "child_pids", "find_leaks", "kill_processes", "fork_server_pid"]


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """Live non-daemon threads and child processes at one moment."""

    threads: frozenset[threading.Thread]
    pids: frozenset[int]


def child_pids() -> frozenset[int]:
    """Process ids of this process's live children and of the workers' fork server's
    (whose workers belong to this process's tests), zombies excluded, read from /proc."""
    parents = {os.getpid()}
    server = fork_server_pid()
    if server is not None:
        parents.add(server)
    found = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # Gone meanwhile.
        # Fields after the parenthesised command name: state, ppid, ...
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) >= 2 and int(fields[1]) in parents and fields[0] != b"Z":
            found.add(int(name))
    return frozenset(found)


def _non_daemon_threads() -> frozenset[threading.Thread]:
    return frozenset(t for t in threading.enumerate() if not t.daemon and t.is_alive())


def fork_server_pid() -> int | None:
    """The pid of multiprocessing's fork server (the harness's workers' parent), if one runs."""
    return getattr(forkserver._forkserver, "_forkserver_pid", None)


def _infrastructure_pids() -> set[int]:
    """Helper processes multiprocessing keeps for the whole session."""
    # The spawn and forkserver start methods launch one resource tracker per session, on
    # first use; the forkserver method also its server.
    pids = {getattr(getattr(resource_tracker, "_resource_tracker", None), "_pid", None), fork_server_pid()}
    return {pid for pid in pids if pid}


def snapshot() -> Snapshot:
    """Records the live non-daemon threads and child processes."""
    multiprocessing.active_children()  # Reaps finished multiprocessing children.
    return Snapshot(_non_daemon_threads(), child_pids())


def find_leaks(
    before: Snapshot, *, ignore_pids: Iterable[int] = (), settle: float = 1.0
) -> tuple[list[threading.Thread], list[int]]:
    """Returns the threads and child processes started since ``before`` still alive.

    Threads and processes that are ending get up to ``settle`` seconds in all.

    Args:
        before: Snapshot taken before the test.
        ignore_pids: Processes that may outlive a test (the shared worker pool).
        settle: Seconds, in total, to wait for threads and processes that are ending.

    Returns:
        ``(threads, pids)`` that leaked.
    """
    deadline = time.monotonic() + settle
    allowed = set(before.pids) | set(ignore_pids) | _infrastructure_pids()
    threads = [t for t in _non_daemon_threads() if t not in before.threads]
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    for process in multiprocessing.active_children():  # Reaps and joins the ending ones.
        if process.pid not in allowed:
            process.join(max(0.0, deadline - time.monotonic()))
    leaked = child_pids() - allowed
    if leaked or any(t.is_alive() for t in threads):
        # Garbage not collected yet (a reference cycle) may own them, and its finalizers end them (a disk
        # table's writer process ends when its store is collected): collect, then give them the time left.
        gc.collect()
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        leaked = child_pids() - allowed
        while leaked and time.monotonic() < deadline:
            time.sleep(0.02)
            leaked = child_pids() - allowed
    leaked_threads = [t for t in threads if t.is_alive()]
    return leaked_threads, sorted(leaked)


def kill_processes(pids: Iterable[int]) -> None:
    """SIGKILLs leaked child processes, so they cannot disturb later tests.

    Those started by ``multiprocessing`` are reaped here. Others are left for their
    owner (e.g. a ``subprocess.Popen``) to reap, so it still sees their exit status;
    meanwhile they are zombies, which :func:`child_pids` does not count.
    """
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    multiprocessing.active_children()
