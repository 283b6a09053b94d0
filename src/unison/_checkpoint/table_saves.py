"""How a backup saves embedding tables by delta: the contract it asks of a table module, and a switch.

A recommendation model's tables are most of its bytes and change by a few per cent between
two saves. :class:`~unison._checkpoint.backup.BackupAndRestore` (with ``full_every``) saves
the rest of a model with ``state_dict()`` as before and each table module by its own
``delta_state_dict`` (a full one every so often, deltas between): while
:func:`leaving_tables_out` is active, a table module leaves itself out of
``state_dict()`` and ``load_state_dict()``. The contract is a protocol, so this layer
names no embedding module (``unison._embeddings.modules`` sits above it).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

__all__ = ["DeltaSaving", "leaving_tables_out", "tables_left_out"]

_LEFT_OUT: contextvars.ContextVar[bool] = contextvars.ContextVar("unison_tables_left_out", default=False)


@runtime_checkable
class DeltaSaving(Protocol):
    """A module whose state saves as a chain: a full save point, then what changed since each one."""

    def delta_state_dict(self, full: bool = False) -> dict[str, Any]:
        """A new save point: what changed since the previous one, or everything (``full``)."""
        ...

    def load_delta_state_dict(self, delta: Mapping[str, Any]) -> None:
        """Applies the next delta of the chain."""
        ...


def tables_left_out() -> bool:
    """Whether a table module should leave itself out of ``state_dict()``/``load_state_dict()`` now."""
    return _LEFT_OUT.get()


@contextlib.contextmanager
def leaving_tables_out() -> Iterator[None]:
    """Within it, ``state_dict()`` and ``load_state_dict()`` of a model skip its table modules."""
    token = _LEFT_OUT.set(True)
    try:
        yield
    finally:
        _LEFT_OUT.reset(token)
