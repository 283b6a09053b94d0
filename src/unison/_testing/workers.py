"""``run_workers``: run a function in fresh worker processes, one per rank.

Use it for tests that need real processes of their own: forming and destroying
process groups, multi-worker strategies, the coordinator, the launcher and fault
tests. For many small collective tests, :class:`~unison._testing.pool.WorkerPool` saves
the start-up of a process per test.
"""

from __future__ import annotations

import signal
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import cloudpickle

from unison._testing import _child, _procs
from unison._testing.rendezvous import RENDEZVOUS_ENV, serve_rendezvous
from unison._testing.results import WorkerFailure, WorkerResult, WorkerTimeout

__all__ = ["run_workers"]

DEFAULT_FAILURE_GRACE_S = 3.0


def run_workers(
    fn: Callable[..., Any],
    world_size: int = 2,
    *,
    args: Sequence[Any] = (),
    timeout: float = 60.0,
    env: Mapping[str, str | None] | None = None,
    allow_failures: bool = False,
    failure_grace: float = DEFAULT_FAILURE_GRACE_S,
) -> list[Any]:
    """Runs ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes.

    Processes are forked from a fork server that imported torch once (each starts in
    milliseconds, not the seconds of a spawned interpreter importing torch; the server
    only imported modules, so a worker is as clean as a spawned one) and start with the
    test process's environment of the moment, as spawned ones would; where Linux has no
    pidfd (to tie a worker to the test process) they are spawned. ``fn`` and ``args``
    travel with cloudpickle, so test-local functions and closures work (functions defined at
    module level in a test module are imported by name in the worker, from the
    ``sys.path`` of the test process). The parent serves a ``TCPStore`` on port 0 for
    the call; workers find it in ``UNISON_RENDEZVOUS`` (see
    :func:`~unison._testing.rendezvous.connect_rendezvous_store`). Workers start with
    ``GLOO_SOCKET_IFNAME=lo``, ``OMP_NUM_THREADS=1``, ``MASTER_ADDR=127.0.0.1`` and one
    torch thread; SIGUSR1 dumps their stacks to their stderr, which is captured and
    copied to this process's stderr afterwards. A default process group a worker
    leaves initialised is destroyed when ``fn`` returns.

    Nothing outlives the call: on return, on error and on timeout every worker is
    killed if still running and joined, and the store is closed.

    Args:
        fn: Called as ``fn(rank, world_size, *args)`` in each worker.
        world_size: Number of worker processes.
        args: Further positional arguments for ``fn``.
        timeout: Seconds for the whole call, start-up included. Give process groups
            a shorter timeout, so a hung collective becomes an exception in a worker.
        env: Environment overrides for the workers; a value of None unsets a variable.
        allow_failures: Return every rank's :class:`WorkerResult` instead of raising
            when a rank fails (for fault tests that kill a worker on purpose).
        failure_grace: Without ``allow_failures``: once a rank has failed, seconds
            the others get to finish before their stacks are dumped and they are killed.

    Returns:
        ``fn``'s return values in rank order; with ``allow_failures``, one
        :class:`WorkerResult` per rank instead.

    Raises:
        WorkerFailure: A rank raised or its process died (not with ``allow_failures``);
            the message has each failed rank's traceback or exit code.
        WorkerTimeout: Ranks were still running after ``timeout`` seconds; the message
            names them and shows their stacks. Raised with ``allow_failures`` too.
        ValueError: ``world_size`` < 1 or ``timeout`` <= 0.
        TypeError: ``fn`` is not callable.
    """
    if not callable(fn):
        raise TypeError(f"run_workers(fn=...) must be callable, got {type(fn).__qualname__}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"run_workers(world_size={world_size!r}) must be an int >= 1")
    if timeout <= 0:
        raise ValueError(f"run_workers(timeout={timeout!r}) must be > 0 seconds")
    job = cloudpickle.dumps((fn, tuple(args)))  # Fails here, in the test, if unpicklable.
    deadline = time.monotonic() + timeout
    with serve_rendezvous(timeout) as address, tempfile.TemporaryDirectory(
        prefix="unison-workers-"
    ) as tmpdir:
        child_env = {**_procs.BASE_CHILD_ENV, RENDEZVOUS_ENV: address, **(env or {})}
        children: list[_procs.ChildProcess] = []
        stacks: dict[int, str] = {}
        dump_offsets: dict[int, int] = {}
        try:
            children = _procs.spawn_children(
                _child.worker_main, world_size, (job,), child_env, tmpdir, duplex=False
            )
            status = _procs.wait_until(
                children,
                lambda: all(c.exitcode is not None for c in children),
                deadline,
                None if allow_failures else failure_grace,
            )
            if status != "done":
                dump_offsets = {c.rank: c.stderr_size() for c in children}
                stacks = _procs.dump_stacks(children)
        finally:
            _procs.reap(children)
        # A stack dump goes into the rank's `error`, not into its `stderr`.
        stderr = _procs.relay_stderr(children, {}, dump_offsets or None)
        results = [_result(c, stacks.get(c.rank), stderr[c.rank]) for c in children]
    if status == "timeout":
        raise WorkerTimeout(
            results,
            f"run_workers timed out after {timeout:g} s: rank(s) {sorted(stacks)} of "
            f"world_size {world_size} still running (stacks below, then killed)",
        )
    if allow_failures:
        return results
    if any(not r.ok for r in results):
        raise WorkerFailure(results)
    return [r.value for r in results]


def _result(child: _procs.ChildProcess, stack: str | None, stderr: str) -> WorkerResult:
    code = child.exitcode
    outcome = child.outcome
    if stack is not None:
        if outcome is not None and outcome[0] == "ok":
            what = (
                f"rank {child.rank} returned, but its process did not exit (a non-daemon "
                "thread or the process-group teardown hangs?)"
            )
        else:
            what = f"rank {child.rank} was still running"
        return WorkerResult(child.rank, code, None, f"{what}; stack:\n{stack}", stderr)
    if outcome is None:
        return WorkerResult(child.rank, code, None, _describe_exit(child.rank, code), stderr)
    kind, payload = outcome
    if kind != "ok":
        return WorkerResult(child.rank, code, None, payload, stderr)
    if code != 0:
        error = f"rank {child.rank} returned, then its process exited with code {code}"
        return WorkerResult(child.rank, code, payload, error, stderr)
    return WorkerResult(child.rank, code, payload, None, stderr)


def _describe_exit(rank: int, code: int | None) -> str:
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"rank {rank} was killed by {name} (exit code {code}) before returning"
    return f"rank {rank} exited with code {code} before returning"
