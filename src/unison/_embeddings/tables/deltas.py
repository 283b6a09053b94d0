"""What a table's saves since the last one hold: delta checkpoints and serving exports, and their checks.

A recommendation table is many gigabytes and only a few per cent of its rows change
between two saves, so a save may hold only those (DeepRec's, Monolith's and Persia's
incremental checkpoints). Every table carries a **table id** (``meta["table_id"]``, made
when the table is made, kept by its checkpoints and by every table loaded from them) and
a **sequence number** (``meta["sequence"]``: how many save points the table has passed).
A delta is what changed from save point ``base`` to ``sequence = base + 1``: the rows
made, read or updated since (with their optimizer state, counts and last-seen steps), the
ids removed since and not back (``"removed"``, tombstones), the admission sketch whole
(it is small and its counters move both ways), and the table's step. A table takes a
delta only when its id is the delta's and its sequence is the delta's base: a delta of
another table, one out of order or one applied twice is refused with both named, before
anything changes.

A full ``state_dict`` taken between save points still loads and takes the next delta (a
delta is applied by replacing rows, so rows that changed before the full save and are in
the delta again come out the same); its meta says it is not ``exact``, and a table loaded
from it refuses to write a delta of its own until it has taken the next one (or made a
new save point with a full save): the rows it changed between the save point and the
full save would be in no delta.

Serving exports (``ids`` and ``rows`` only) follow the same rules with their own chain: a
full export starts one (a new ``export_id``), and each delta export names its base.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["DELTA_META_KEYS", "check_next", "checked_delta", "SAVE_POINT_KEYS"]

SAVE_POINT_KEYS = ("table_id", "sequence", "exact")
"""What a full export's meta adds: the table's id, its last save point, and whether the export holds exactly
that save point (nothing changed since)."""
DELTA_META_KEYS = ("table_id", "base", "sequence")


def checked_delta(delta: Any, where: str) -> dict[str, Any]:
    """A delta's meta after checking the parts a delta has beyond an export's (``removed``, its chain).

    Raises:
        ValueError: naming the missing field and the fix.
    """
    if not isinstance(delta, dict) or "removed" not in delta or "meta" not in delta:
        got = sorted(delta) if isinstance(delta, dict) else type(delta).__name__
        raise ValueError(f"{where}: not a table delta (needs keys 'removed' and 'meta' with {DELTA_META_KEYS}), got "
                         f"{got}; fix: pass what delta_state_dict() returned (a full state_dict loads with "
                         f"load_state_dict)")
    meta = delta["meta"]
    missing = [key for key in DELTA_META_KEYS if key not in meta]
    if missing:
        raise ValueError(f"{where}: the delta's meta lacks {missing}; fix: pass what delta_state_dict() returned")
    removed = delta["removed"]
    if not isinstance(removed, torch.Tensor) or removed.dtype != torch.int64 or removed.dim() != 1:
        raise ValueError(f"{where}: the delta's `removed` must be a 1-D int64 tensor of ids, got {removed!r:.80}")
    return meta


def check_next(where: str, table_id: str | None, sequence: int, delta_id: str, base: int, delta_sequence: int) -> None:
    """Refuses (naming both) a delta that does not continue this table's chain.

    Raises:
        ValueError: another table's delta, one out of order, or one already applied.
    """
    if delta_id != table_id:
        raise ValueError(f"{where}: the delta is of table {delta_id!r} (save {base} -> {delta_sequence}) but this "
                         f"table is {table_id!r} (at save {sequence}); nothing was changed. fix: load the full "
                         f"checkpoint of table {delta_id!r} first, then its deltas in order")
    if base != sequence:
        what = "was already applied" if delta_sequence <= sequence else "is out of order"
        raise ValueError(f"{where}: the delta of table {delta_id!r} goes from save {base} to {delta_sequence} but "
                         f"this table is at save {sequence}: it {what}; nothing was changed. fix: apply the deltas "
                         f"in order, each once, starting with the one whose base is {sequence}")
