"""``WorkerPool``: warm worker processes with a process group formed once.

Starting processes and forming their process group costs a noticeable share of a small
test on a 2-core machine; the many small collective tests share one pool instead (the
``worker_pool`` pytest fixture).
Tests that form or destroy process groups, or kill workers, use ``run_workers``.
"""

from __future__ import annotations

import contextlib
import functools
import tempfile
import time
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any

import cloudpickle

from unison._testing import _child, _procs
from unison._testing.rendezvous import RENDEZVOUS_ENV, init_test_process_group, serve_rendezvous
from unison._testing.results import WorkerFailure, WorkerResult, WorkerTimeout

__all__ = ["WorkerPool"]

# Seconds a member gets to exit after the pool asks it to.
_CLOSE_WAIT_S = 5.0


class WorkerPool:
    """Long-lived worker processes sharing a gloo process group.

    Members start on first use (or on ``start()`` / entering the ``with`` block) and
    form the default process group once. ``run`` sends ``fn`` with cloudpickle to every
    member and returns the results by rank. When a call fails, the pool stays if every
    member came back (the group is idle and consistent); if a member died, hung, was
    stopped, or ``fn`` destroyed the group, the pool shuts the members down and starts
    new ones on the next call, so a failure never hangs a later test. A member restores
    ``os.environ`` after each call. Not thread-safe: one ``run`` at a time.

    Example:
        >>> with WorkerPool(2) as pool:  # doctest: +SKIP
        ...     pool.run(lambda rank, world_size: rank * 10)
        [0, 10]

    Args:
        world_size: Number of member processes.
        env: Environment overrides for the members, as for ``run_workers``.
        group_timeout: Seconds for the group's rendezvous and for each collective;
            keep it below ``run`` timeouts so a hung collective raises in the member.
        start_timeout: Seconds for members to start and form the group.
        failure_grace: Once a member has failed a call, seconds the others get to
            finish before their stacks are dumped and the pool is rebuilt.
    """

    def __init__(
        self,
        world_size: int = 2,
        *,
        env: Mapping[str, str | None] | None = None,
        group_timeout: float = 20.0,
        start_timeout: float = 60.0,
        failure_grace: float = 1.0,
    ) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"WorkerPool(world_size={world_size!r}) must be an int >= 1")
        self._world_size = world_size
        self._env = dict(env or {})
        self._group_timeout = group_timeout
        self._start_timeout = start_timeout
        self._failure_grace = failure_grace
        self._children: list[_procs.ChildProcess] = []
        # The members' store server and stderr directory, closed with the members.
        self._resources = contextlib.ExitStack()
        self._generation = 0
        self._closed = False

    @property
    def world_size(self) -> int:
        """Number of member processes."""
        return self._world_size

    @property
    def generation(self) -> int:
        """How many times members were started (a rebuild after a failure adds one)."""
        return self._generation

    @property
    def pids(self) -> frozenset[int]:
        """Process ids of the current members (empty when none run)."""
        return frozenset(c.process.pid for c in self._children if c.process.pid is not None)

    def __enter__(self) -> WorkerPool:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def start(self) -> None:
        """Starts the members and forms their group, unless they already run.

        Raises:
            RuntimeError: The pool was closed.
            WorkerFailure: A member could not start or form the group.
            WorkerTimeout: Members were not ready within ``start_timeout``.
        """
        if self._closed:
            raise RuntimeError("WorkerPool.start() on a closed pool; create a new WorkerPool")
        if self._children:
            return
        deadline = time.monotonic() + self._start_timeout
        self._generation += 1
        try:
            tmpdir = self._resources.enter_context(
                tempfile.TemporaryDirectory(prefix="unison-pool-")
            )
            address = self._resources.enter_context(serve_rendezvous(self._group_timeout))
            form_group = functools.partial(
                init_test_process_group,
                prefix=f"unison_testing/pool/{self._generation}",
                timeout=self._group_timeout,
            )
            env = {**_procs.BASE_CHILD_ENV, RENDEZVOUS_ENV: address, **self._env}
            self._children = children = _procs.spawn_children(
                _child.pool_member_main,
                self._world_size,
                (form_group,),
                env,
                tmpdir,
                duplex=True,
            )
            # Each member answers the start like a call: ("ok", None) once it is in
            # the group, or the traceback of forming it.
            self._finish_call(
                {c.rank: 0 for c in children},
                deadline,
                f"WorkerPool(world_size={self._world_size}) start-up",
            )
        except BaseException:
            self._shutdown(graceful=False)
            raise

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 30.0) -> list[Any]:
        """Runs ``fn(rank, world_size, *args)`` on every member.

        Args:
            fn: Sent with cloudpickle; closures and test-local functions work.
            *args: Further positional arguments for ``fn``.
            timeout: Seconds for the call.

        Returns:
            ``fn``'s return values in rank order.

        Raises:
            WorkerFailure: A member raised, died or destroyed the process group.
            WorkerTimeout: Members were still running after ``timeout`` seconds; the
                message shows their stacks. The pool is rebuilt on the next call.
        """
        job = cloudpickle.dumps((fn, args))  # Fails here, in the test, if unpicklable.
        self.start()
        deadline = time.monotonic() + timeout
        offsets = {c.rank: c.stderr_size() for c in self._children}
        for child in self._children:
            child.outcome = None
            try:
                if child.conn is not None:
                    child.conn.send_bytes(job)
            except OSError:
                pass  # The member died; its exit is seen while waiting.
        return self._finish_call(offsets, deadline, f"WorkerPool.run(timeout={timeout:g})")

    def _finish_call(self, offsets: dict[int, int], deadline: float, what: str) -> list[Any]:
        """Waits for every member's outcome of the current call and returns the values.

        Raises:
            WorkerFailure: A member failed; if one died, was stopped or lost the group,
                the pool is shut down first, to restart on the next call.
            WorkerTimeout: A member was still running at ``deadline``.
        """
        children = self._children
        status = _procs.wait_until(
            children,
            lambda: all(c.outcome is not None or c.exitcode is not None for c in children),
            deadline,
            self._failure_grace,
        )
        if status != "done":
            self._fail(offsets, status, what)
        stderr = _procs.relay_stderr(children, offsets)
        results = [self._result(c, stderr[c.rank]) for c in children]
        group_lost = any(c.group_lost for c in children)
        if group_lost or any(c.exitcode is not None for c in children):
            self._shutdown(graceful=False)
        if group_lost:
            raise WorkerFailure(
                results,
                f"{what}: fn destroyed the WorkerPool's process group; the pool restarts "
                "on the next call. Use run_workers() for tests that form or destroy groups",
            )
        failed = [r.rank for r in results if not r.ok]
        if failed:
            raise WorkerFailure(results, f"{what}: rank(s) {failed} failed")
        return [r.value for r in results]

    def close(self) -> None:
        """Asks the members to exit (killing those that do not) and closes the pool."""
        self._closed = True
        self._shutdown(graceful=True)

    def _fail(self, offsets: dict[int, int], status: str, what: str) -> None:
        """Dumps the stacks of members still busy, shuts the pool down and raises."""
        children = self._children
        busy = [c for c in children if c.outcome is None and c.exitcode is None]
        dump_at = {c.rank: c.stderr_size() for c in children}
        stacks = _procs.dump_stacks(busy)
        _procs.reap(children)
        stderr = _procs.relay_stderr(children, offsets, dump_at)
        results = []
        for child in children:
            if child.rank in stacks:
                error = f"rank {child.rank} was still running; stack:\n{stacks[child.rank]}"
                results.append(
                    WorkerResult(child.rank, child.exitcode, None, error, stderr[child.rank])
                )
            else:
                results.append(self._result(child, stderr[child.rank]))
        self._shutdown(graceful=False)
        running = sorted(stacks)
        if status == "timeout":
            raise WorkerTimeout(results, f"{what} timed out: rank(s) {running} still running")
        if status == "exited":
            raise WorkerFailure(results, f"{what}: every member exited; the pool restarts")
        raise WorkerFailure(
            results,
            f"{what}: a member failed and rank(s) {running} did not finish within "
            f"{self._failure_grace:g} s of it; the pool restarts on the next call",
        )

    @staticmethod
    def _result(child: _procs.ChildProcess, stderr: str) -> WorkerResult:
        if child.outcome is None:
            error = f"rank {child.rank} exited with code {child.exitcode} during the call"
            return WorkerResult(child.rank, child.exitcode, None, error, stderr)
        kind, payload = child.outcome
        if kind == "ok":
            return WorkerResult(child.rank, child.exitcode, payload, None, stderr)
        return WorkerResult(child.rank, child.exitcode, None, payload, stderr)

    def _shutdown(self, *, graceful: bool) -> None:
        """Stops the members (politely if ``graceful``), the store and the temp dir."""
        children, self._children = self._children, []
        try:
            if graceful:
                for child in children:
                    try:
                        if child.conn is not None:
                            child.conn.send_bytes(b"")
                    except OSError:
                        pass
                _procs.wait_until(
                    children,
                    lambda: all(c.exitcode is not None for c in children),
                    time.monotonic() + _CLOSE_WAIT_S,
                )
        finally:
            _procs.reap(children)
            self._resources.close()
