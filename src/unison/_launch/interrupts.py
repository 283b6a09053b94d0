"""The launcher's own signals: SIGTERM and SIGHUP raise :class:`Interrupted`, as Ctrl-C raises.

A launcher that gets a signal must stop every task it started before it exits, so the
signal becomes an exception that unwinds through the same ``stop()`` as a failure. Both
the one-node and the multi-node launchers install these handlers around their run and
restore the previous ones after it.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Mapping
from types import FrameType
from typing import Any

__all__ = ["Interrupted", "install_signal_handlers", "restore_signal_handlers"]


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
