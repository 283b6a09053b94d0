"""The coordinator's queue of scheduled functions, with TensorFlow's error semantics.

The first error a function raises is kept; the functions still queued are cancelled
(their RemoteValues raise ``FunctionCancelledError``); the next ``schedule()``,
``join()`` or ``done()`` raises the error, once, and clears it. A function whose
worker died is put back at the front and runs again elsewhere (at-least-once).

tf.distribute equivalent: ``_CoordinatedClosureQueue`` of TensorFlow's ``cluster_coordinator.py``.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any

from unison._ps.chief.remote_values import RemoteValue
from unison.errors import FunctionCancelledError

__all__ = ["Closure", "ClosureQueue"]


class Closure:
    """A scheduled function and its arguments, pickled once, and its RemoteValue."""

    def __init__(self, payload: bytes, fn_name: str):
        self.payload = payload
        self.fn_name = fn_name
        self.result = RemoteValue()
        self.attempts = 0


class ClosureQueue:
    """Thread-safe queue of closures, feeding one thread per worker."""

    def __init__(self) -> None:
        self._queue: collections.deque[Closure] = collections.deque()
        self._inflight = 0
        self._error: BaseException | None = None
        self._fatal: BaseException | None = None
        self._cond = threading.Condition()
        self._stopped = False

    # -- the coordinator's side ---------------------------------------------------------
    def _raise_error_locked(self) -> None:
        if self._fatal is not None:
            raise self._fatal  # a lost ps: stays until the cluster is restarted
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def put(self, closure: Closure) -> None:
        """Queues ``closure``; raises the pending error first, if any."""
        with self._cond:
            self._raise_error_locked()
            self._queue.append(closure)
            self._cond.notify_all()

    def wait(self, timeout_check: Callable[[], None] = lambda: None) -> None:
        """Blocks until every closure finished or one failed; raises the error once."""
        with self._cond:
            while (self._queue or self._inflight) and self._error is None and self._fatal is None:
                self._cond.wait(0.5)
                timeout_check()
            self._raise_error_locked()

    def done(self) -> bool:
        """Whether nothing is queued or running; raises the pending error first."""
        with self._cond:
            self._raise_error_locked()
            return not self._queue and not self._inflight

    # -- the workers' side --------------------------------------------------------------
    def get(self, timeout: float = 0.5) -> Closure | None:
        """The next closure (now in flight), or None after ``timeout`` or when stopped."""
        with self._cond:
            if not self._queue and not self._stopped:
                self._cond.wait(timeout)
            if self._stopped or not self._queue:
                return None
            self._inflight += 1
            return self._queue.popleft()

    def finished(self, closure: Closure, value: Any) -> None:
        """``closure`` returned ``value``."""
        with self._cond:
            self._inflight -= 1
            closure.result._set(value)
            self._cond.notify_all()

    def failed(self, closure: Closure, error: BaseException) -> None:
        """``closure`` raised ``error``: keep it (if first) and cancel what is queued."""
        with self._cond:
            self._inflight -= 1
            closure.result._fail(error)
            if self._error is None:
                self._error = error
            self._cancel_queued_locked(f"an earlier function failed with {type(error).__name__}: {error}")
            self._cond.notify_all()

    def put_back(self, closure: Closure) -> None:
        """``closure``'s worker was lost: run it again, first."""
        with self._cond:
            self._inflight -= 1
            closure.attempts += 1
            if self._fatal is not None or self._stopped:
                closure.result._fail(self._fatal or FunctionCancelledError("the coordinator shut down"))
            else:
                self._queue.appendleft(closure)
            self._cond.notify_all()

    def fail_all(self, error: BaseException) -> None:
        """A fatal error (a lost ps task): every queued closure fails with it; it stays raised."""
        with self._cond:
            if self._fatal is None:
                self._fatal = error
            while self._queue:
                self._queue.popleft().result._fail(error)
            self._cond.notify_all()

    @property
    def fatal(self) -> BaseException | None:
        """The fatal error, if any."""
        return self._fatal

    def _cancel_queued_locked(self, why: str) -> None:
        while self._queue:
            closure = self._queue.popleft()
            closure.result._fail(FunctionCancelledError(
                f"the function {closure.fn_name!r} was cancelled because {why}; reschedule it"
            ))

    def stop(self) -> None:
        """Wakes every worker thread for shutdown; queued closures are cancelled."""
        with self._cond:
            self._stopped = True
            self._cancel_queued_locked("the coordinator shut down")
            self._cond.notify_all()
