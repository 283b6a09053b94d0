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
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from unison.errors import CheckpointError

__all__ = ["DeltaSaving", "leaving_tables_out", "tables_left_out", "delta_saving_modules", "load_table_chain"]

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


def delta_saving_modules(state: Mapping[str, Any]) -> dict[str, DeltaSaving]:
    """Every table module in ``state`` (an entry itself, or a submodule of a module entry), by
    ``"<state name>:<module path>"``."""
    found: dict[str, DeltaSaving] = {}
    for name, item in state.items():
        named = getattr(item, "named_modules", None)
        parts = list(named()) if callable(named) else [("", item)]
        for path, module in parts:
            if isinstance(module, DeltaSaving):
                found[f"{name}:{path}"] = module
    return found


def load_table_chain(directory: Path, chain: list[str], tables: Mapping[str, DeltaSaving]) -> None:
    """Loads a backup's table files in order: the first a full save point, the others its deltas.

    Raises:
        CheckpointError: a file of the chain is missing, or names tables the state does not hold.
    """
    for position, file in enumerate(chain):
        path = directory / file
        if not path.is_file():
            raise CheckpointError(f"the backup in {str(directory)!r} needs table file {file!r} (part {position} "
                                  f"of {chain}), which is missing; delete the backup to start over")
        saved = torch.load(path, map_location="cpu", weights_only=False)
        missing = sorted(set(saved) - set(tables))
        if missing:
            raise CheckpointError(f"the backup's table file {file!r} holds tables {missing} that the state does not "
                                  f"have (it has {sorted(tables)}); pass the same model as the run that wrote it")
        for key, part in saved.items():
            if position == 0:
                tables[key].load_state_dict(part)  # type: ignore[attr-defined]
            else:
                tables[key].load_delta_state_dict(part)
