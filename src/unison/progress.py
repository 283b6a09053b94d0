"""Progress of a loop that reads well on a terminal and in a log.

On a terminal a live bar (tqdm) is the thing to watch; in a log or a CI job its
carriage-return redraws pile up into one line. :func:`track` draws the bar only where
a terminal will show it, and otherwise writes one plain line at most every ``interval``
seconds and one when the loop ends. Under ``unison launch`` a task's streams are pipes
to the launcher; the launcher says which of its own streams are terminals
(``UNISON_TERMINAL``), and a task draws its bar when the launcher's stream is one.

tf.distribute equivalent: none (Keras' ``fit`` has ``verbose=1`` for a bar and
``verbose=2`` for one line per epoch, chosen the same way by ``verbose="auto"``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import IO, TypeVar

from unison._cluster import env

__all__ = ["track", "shows_live_bar"]

T = TypeVar("T")


def shows_live_bar(file: IO[str]) -> bool:
    """Whether text written to ``file`` ends on a terminal, so that a redrawn bar is seen as one.

    True when ``file`` is a terminal, or when it is this process's stdout or stderr and
    ``unison launch``, which relays them, writes that stream to a terminal.
    """
    try:
        if file.isatty():
            return True
        descriptor = file.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    streams = env.terminal_streams()
    if streams is None:
        return False
    return {1: "stdout", 2: "stderr"}.get(descriptor) in streams


def track(
    iterable: Iterable[T],
    desc: str = "",
    *,
    total: int | None = None,
    initial: int = 0,
    disable: bool = False,
    leave: bool = False,
    file: IO[str] | None = None,
    interval: float = 10.0,
    clock: Callable[[], float] = time.monotonic,
) -> Iterator[T]:
    """Iterates over ``iterable``, showing how far it got: a live bar or plain lines.

    A drop-in for ``tqdm(iterable, desc=..., ...)`` in a training loop. Where
    :func:`shows_live_bar` says a terminal shows ``file``, it is tqdm's bar. Elsewhere it
    writes ``"epoch 1/12: 12/23 (52%), 5.1 s, 2.4 it/s"`` at most once every
    ``interval`` seconds, and ``"epoch 1/12: 23/23 in 9.6 s (2.4 it/s)"`` when the
    iterable is exhausted (a loop left with ``break`` writes no such line).

    Args:
        iterable: what to iterate over.
        desc: what the loop is, at the start of the bar or of each line.
        total: how many items it yields in all (default: ``len(iterable)`` if it has one).
        initial: how many were done before (a resumed epoch); counted in, not in the rate.
        disable: no output at all (e.g. on every task but the chief).
        leave: keep the bar once the loop ends (the bar only).
        file: where to write (default: ``sys.stderr``, as tqdm).
        interval: the shortest time in seconds between two lines (not the bar).
        clock: seconds, monotonic (tests pass their own).

    Returns:
        An iterator over the items of ``iterable``.
    """
    if disable:
        return iter(iterable)
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)  # type: ignore[arg-type]
    out = sys.stderr if file is None else file
    if shows_live_bar(out):
        from tqdm import tqdm

        return iter(tqdm(iterable, desc=desc, total=total, initial=initial, leave=leave, file=out))
    return _lines(iterable, desc, total, initial, out, interval, clock)


def _lines(iterable: Iterable[T], desc: str, total: int | None, initial: int, out: IO[str], interval: float,
           clock: Callable[[], float]) -> Iterator[T]:
    started = last = clock()
    done = initial
    for item in iterable:
        yield item
        done += 1
        now = clock()
        if now - last >= interval:
            last = now
            elapsed = now - started
            share = f" ({100 * done / total:.0f}%)" if total else ""
            _write(out, f"{desc}: {_count(done, total)}{share}, {elapsed:.1f} s, {_rate(done - initial, elapsed)}")
    elapsed = clock() - started
    _write(out, f"{desc}: {_count(done, total)} in {elapsed:.1f} s ({_rate(done - initial, elapsed)})")


def _count(done: int, total: int | None) -> str:
    return f"{done}/{total}" if total is not None else str(done)


def _rate(items: int, seconds: float) -> str:
    if seconds <= 0:
        return "- it/s"
    rate = items / seconds
    return f"{rate:.3g} it/s" if rate < 1000 else f"{rate:.0f} it/s"


def _write(out: IO[str], line: str) -> None:
    out.write(line + "\n")
    out.flush()
