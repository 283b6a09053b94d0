"""``LowerTier``: the rows of a table kept below its in-memory ``LocalTable`` (a disk tier's cold rows).

A table with a disk tier is one table in two places: the hot rows in a ``LocalTable``,
the cold ones on disk. Its save points (delta checkpoints, serving exports) are one chain
whatever tier a row sits in, so the ``LocalTable`` that keeps the chain (table id,
sequence, save epochs, the log of removed ids) asks the tier below it for the rest: the
rows there changed since a save epoch, and whether an id removed from memory still has a
row below (a spilled row is moved, not removed). The contract is here, beside neither
implementation, so the in-memory table does not import the disk tier.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

__all__ = ["LowerTier"]


class LowerTier(Protocol):
    """What a ``LocalTable``'s save points read of the rows of its table kept below it.

    Each row there carries the save epoch (the ``LocalTable``'s) in which it last changed,
    kept when it moved down.
    """

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """Positions of ``ids`` below, -1 for those without a row there."""
        ...

    def take_back(self, ids: torch.Tensor) -> list[dict[str, Any]]:
        """The rows below among distinct ``ids`` (none of them in memory), moved up: no longer below. One
        export per set of optimizer states, each as ``LocalTable.take(..., moving=True)`` gave it (with
        ``"changed_in"``; its ``meta`` holds ``state_init``); none when no id has a row below."""
        ...

    def joined(self, export: dict[str, Any], changed_after: int | None) -> dict[str, Any]:
        """``export`` (of rows in memory) with the rows below changed after save epoch ``changed_after``
        (every row below: None), as one export sorted by id."""
        ...

    def changed_since(self, epoch: int) -> bool:
        """Whether a row below changed after save epoch ``epoch``."""
        ...

    def serving_rows(self, changed_after: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids, rows)`` of the rows below changed after ``changed_after`` (every row: None), any order."""
        ...
