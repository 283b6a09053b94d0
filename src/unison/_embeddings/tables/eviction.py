"""Which rows of a dynamic table to drop: policies over each row's touch count and last step.

Ids of a recommendation model arrive without end (new users, new items, hash noise), so a
table that only grows runs out of memory. A policy names the rows worth forgetting from
two numbers the table keeps per row: how often lookups asked for it and the table step
at which it was last looked up or updated. An evicted row that comes back is created
afresh, with its initial values and no optimizer state.
"""

from __future__ import annotations

import abc
from typing import Any, final

import torch

__all__ = ["EvictionPolicy", "EvictUnseen", "EvictBelowCount"]


def _count(value: Any, field: str, owner: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner}: `{field}` must be an int >= {minimum}, got {value!r}")
    return value


class EvictionPolicy(abc.ABC):
    """Chooses rows to evict from their per-row counters."""

    @abc.abstractmethod
    def select(self, counts: torch.Tensor, last_seen: torch.Tensor, step: int) -> torch.Tensor:
        """A bool mask over the rows: True where the row is to be evicted.

        Args:
            counts: int64 per row, occurrences of its id in ``lookup(create=True)`` calls.
            last_seen: int64 per row, the table step of its last lookup or update.
            step: the table's current step (calls of ``step()`` so far).
        """


@final
class EvictUnseen(EvictionPolicy):
    """Evicts rows not looked up or updated for more than ``steps`` calls of ``table.step()``."""

    def __init__(self, steps: int) -> None:
        self.steps = _count(steps, "steps", "EvictUnseen", 0)

    def select(self, counts: torch.Tensor, last_seen: torch.Tensor, step: int) -> torch.Tensor:
        return step - last_seen > self.steps

    def __repr__(self) -> str:
        return f"EvictUnseen(steps={self.steps!r})"


@final
class EvictBelowCount(EvictionPolicy):
    """Evicts rows whose id occurred fewer than ``min_count`` times in lookups (a frequency filter)."""

    def __init__(self, min_count: int) -> None:
        self.min_count = _count(min_count, "min_count", "EvictBelowCount", 1)

    def select(self, counts: torch.Tensor, last_seen: torch.Tensor, step: int) -> torch.Tensor:
        return counts < self.min_count

    def __repr__(self) -> str:
        return f"EvictBelowCount(min_count={self.min_count!r})"
