"""The launcher's own signals: SIGTERM and SIGHUP raise :class:`Interrupted`, as Ctrl-C raises.

A launcher that gets a signal must stop every task it started before it exits, so the
signal becomes an exception that unwinds through the same ``stop()`` as a failure. Both
the one-node and the multi-node launchers install these handlers around their run and
restore the previous ones after it.

Python runs a handler in the main thread, but the kernel hands a signal sent to the process
to any thread that does not block it. One that lands in a helper thread (an output pump)
only marks the handler pending, and a main thread asleep in a wait without a timeout never
runs it: a Ctrl-C sent to a pump thread was ignored until a task ended. (The kernel prefers
the main thread, but not while a signal is pending there.) So the launcher's helper threads
block these signals (:func:`helper_threads_block_signals`), and its waits return every :data:`SIGNAL_POLL_S`
to run a handler that another thread's signal left pending (C threads of libraries, e.g. a
TCPStore's, do not block them).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator, Mapping
from types import FrameType
from typing import Any

__all__ = ["Interrupted", "install_signal_handlers", "restore_signal_handlers", "helper_threads_block_signals",
           "LAUNCHER_SIGNALS", "SIGNAL_POLL_S"]

LAUNCHER_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""The signals that stop a launcher (and every task it started)."""
SIGNAL_POLL_S = 0.5
"""The longest a launcher's main thread waits without running a signal handler that is pending."""


class Interrupted(BaseException):
    """The launcher received ``signum`` (SIGTERM or SIGHUP): stop every task, then exit 128 + signum."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


def _raise_interrupted(signum: int, frame: FrameType | None) -> None:
    raise Interrupted(signum)


def install_signal_handlers() -> dict[signal.Signals, _Handler]:
    # SIGINT already raises KeyboardInterrupt; SIGTERM and SIGHUP are made to stop the cluster too.
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous: dict[signal.Signals, _Handler] = {}
    for signum in (signal.SIGTERM, signal.SIGHUP):
        previous[signum] = signal.signal(signum, _raise_interrupted)
    return previous


def restore_signal_handlers(previous: Mapping[signal.Signals, _Handler]) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler)


@contextlib.contextmanager
def helper_threads_block_signals() -> Iterator[None]:
    """Threads started inside block :data:`LAUNCHER_SIGNALS` (a new thread takes its creator's mask), so
    the kernel hands those signals to the main thread. The main thread's mask is restored on exit (a
    signal that came meanwhile is handled then). Start no process inside: it would inherit the mask."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, LAUNCHER_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
