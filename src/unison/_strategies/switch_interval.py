"""A short GIL switch interval while replica threads run a step.

Replica threads run Python (module calls, dispatch, hooks, the optimizer's loop) between
native ops that release the GIL. When one thread holds the GIL and another waits for it
(the autograd engine calling a gradient hook, a replica woken at a merge), the waiter
gets it when the holder next releases it or, failing that, after the interpreter's
switch interval (``sys.getswitchinterval()``, 5 ms by default) — and a thread that
releases the GIL for a short op and takes it straight back can keep it for that long.
A short interval during a 2-replica step speeds up a step of many small layers and
leaves steps of few layers as they were (``benchmarks/RESULTS.md``, 'Short GIL switch
interval'). The interval is process-wide, so it is
shortened only while some ``run`` of a threaded strategy is in progress (a count, for
concurrent runs), and the caller's interval comes back after the last one.
"""

from __future__ import annotations

import sys
import threading
import typing

__all__ = ["REPLICA_SWITCH_INTERVAL_S", "ShortSwitchInterval", "SHORT_SWITCH_INTERVAL"]

REPLICA_SWITCH_INTERVAL_S = 0.0005
"""The switch interval while replica threads run (seconds)."""


@typing.final
class ShortSwitchInterval:
    """A re-entrant, thread-safe context manager: ``interval`` inside, the caller's after.

    Only shortens: a caller who set an interval shorter than ``interval`` keeps it. If
    the interval was changed by someone else while a run was in progress, that change
    is kept (it is not overwritten with the saved one).
    """

    def __init__(self, interval: float = REPLICA_SWITCH_INTERVAL_S):
        self._interval = interval
        self._lock = threading.Lock()
        self._active = 0
        self._saved: float | None = None  # the caller's interval, while shortened by us

    def __enter__(self) -> None:
        with self._lock:
            self._active += 1
            if self._active == 1:
                current = sys.getswitchinterval()
                if current > self._interval:
                    self._saved = current
                    sys.setswitchinterval(self._interval)

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._active -= 1
            if self._active == 0 and self._saved is not None:
                # sys.setswitchinterval rounds to microseconds: compare within that
                if abs(sys.getswitchinterval() - self._interval) < 1e-6:
                    sys.setswitchinterval(self._saved)
                self._saved = None


SHORT_SWITCH_INTERVAL = ShortSwitchInterval()
"""The process's one instance, entered by every threaded replica runner."""
