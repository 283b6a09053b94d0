"""Which rows of a dynamic table to drop: policies over each row's touch count, last step and idle time.

Ids of a recommendation model arrive without end (new users, new items, hash noise), so a
table that only grows runs out of memory. A policy names the rows worth forgetting from
the numbers the table keeps per row: how often lookups asked for it, the table step at
which it was last looked up or updated, and (for a policy with a ``clock``) how many
seconds ago that was. An evicted row that comes back is created afresh, with its initial
values and no optimizer state.

Time to live in seconds is read from a monotonic clock of the process that owns the rows
(this process on one device, the ps task for its shard): wall-clock jumps (NTP, DST) never
evict a row, and a checkpoint stores each row's idle seconds, not a time stamp, so a
restarted job goes on from the idle time it saved (the time the job was down is not
counted). The clock is a constructor argument, so tests replace it.
"""

from __future__ import annotations

import abc
import math
import time
from collections.abc import Callable
from typing import Any, final

import torch

__all__ = ["EvictionPolicy", "EvictUnseen", "EvictBelowCount"]


def _count(value: Any, field: str, owner: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner}: `{field}` must be an int >= {minimum}, got {value!r}")
    return value


class EvictionPolicy(abc.ABC):
    """Chooses rows to evict from their per-row counters.

    A policy that also reads how long rows have been idle sets ``clock`` (a callable
    returning monotonic seconds): the table then records when each row was last touched
    by it and passes ``idle_seconds`` to :meth:`select`. Policies without one are called
    with the three counters only.
    """

    clock: Callable[[], float] | None = None
    """Monotonic seconds of the process owning the rows, or None when the policy reads no time."""

    @abc.abstractmethod
    def select(self, counts: torch.Tensor, last_seen: torch.Tensor, step: int,
               idle_seconds: torch.Tensor | None = None) -> torch.Tensor:
        """A bool mask over the rows: True where the row is to be evicted.

        Args:
            counts: int64 per row, occurrences of its id in ``lookup(create=True)`` calls.
            last_seen: int64 per row, the table step of its last lookup or update.
            step: the table's current step (calls of ``step()`` so far).
            idle_seconds: float64 per row, seconds by ``clock`` since its last lookup or
                update; given only to a policy whose ``clock`` is set.
        """


@final
class EvictUnseen(EvictionPolicy):
    """Evicts rows not looked up or updated for more than ``steps`` table steps or ``seconds`` seconds.

    A row goes when either limit is exceeded (a time to live in steps, in seconds, or
    both). Steps are calls of ``table.step()``: optimizer steps on one device, pushes on
    a ps shard. Seconds are read from ``clock`` in the process that owns the rows.

    Args:
        steps: unseen for more than this many steps evicts; None: no limit in steps.
        seconds: unseen for more than this many seconds evicts; None: no limit in seconds.
        clock: monotonic seconds (default ``time.monotonic``); replaced by tests. It is
            pickled with the policy, so a ps task reads its own (a module-level function
            such as ``time.monotonic`` pickles by name).

    Raises:
        ValueError: neither limit given, ``steps`` not an int >= 0, or ``seconds`` not a
            finite number >= 0.

    Example:
        >>> EvictUnseen(100), EvictUnseen(seconds=3600.0), EvictUnseen(100, seconds=3600.0)
        (EvictUnseen(steps=100), EvictUnseen(seconds=3600.0), EvictUnseen(steps=100, seconds=3600.0))
    """

    def __init__(self, steps: int | None = None, *, seconds: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if steps is None and seconds is None:
            raise ValueError("EvictUnseen: give `steps` (a time to live in table steps), `seconds` (in seconds of a "
                             "monotonic clock) or both; got neither; fix: e.g. EvictUnseen(100) or "
                             "EvictUnseen(seconds=3600)")
        self.steps = None if steps is None else _count(steps, "steps", "EvictUnseen", 0)
        if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
                                    or not math.isfinite(seconds) or seconds < 0):
            raise ValueError(f"EvictUnseen: `seconds` must be a finite number >= 0 or None, got {seconds!r}")
        if seconds is not None and not callable(clock):
            raise TypeError(f"EvictUnseen: `clock` must be a callable returning monotonic seconds, got {clock!r}")
        self.seconds = None if seconds is None else float(seconds)
        self.clock = None if seconds is None else clock

    def select(self, counts: torch.Tensor, last_seen: torch.Tensor, step: int,
               idle_seconds: torch.Tensor | None = None) -> torch.Tensor:
        chosen = torch.zeros(last_seen.shape, dtype=torch.bool)
        if self.steps is not None:
            chosen |= step - last_seen > self.steps
        if self.seconds is not None and idle_seconds is not None:
            chosen |= idle_seconds > self.seconds
        return chosen

    def __repr__(self) -> str:
        parts = [] if self.steps is None else [f"steps={self.steps!r}"]
        if self.seconds is not None:
            parts.append(f"seconds={self.seconds!r}")
            if self.clock is not time.monotonic:
                parts.append(f"clock={self.clock!r}")
        return f"EvictUnseen({', '.join(parts)})"


@final
class EvictBelowCount(EvictionPolicy):
    """Evicts rows whose id occurred fewer than ``min_count`` times in lookups (a frequency filter)."""

    def __init__(self, min_count: int) -> None:
        self.min_count = _count(min_count, "min_count", "EvictBelowCount", 1)

    def select(self, counts: torch.Tensor, last_seen: torch.Tensor, step: int,
               idle_seconds: torch.Tensor | None = None) -> torch.Tensor:
        return counts < self.min_count

    def __repr__(self) -> str:
        return f"EvictBelowCount(min_count={self.min_count!r})"
