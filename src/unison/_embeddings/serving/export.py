"""``unison.embeddings.export_for_serving``: a trained table's ids and rows, for a ``ServingEmbedding``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from unison._embeddings.modules.dynamic_embedding import DynamicEmbedding
from unison._embeddings.serving.files import write_export

__all__ = ["export_for_serving"]


def export_for_serving(module: DynamicEmbedding, path: str | os.PathLike[str], *, delta: bool = False) -> Path:
    """Writes the ids and rows of ``module``'s table (no optimizer state) for serving.

    The format (``unison._embeddings.serving.files``) is a directory: ``manifest.json`` and
    raw little-endian arrays ``ids.bin``, ``rows.bin``, ``removed.bin``, written under a
    temporary name and renamed into place. A full export (``delta=False``) holds every row
    and starts a chain; a delta export holds the rows made, read or updated since the
    previous export of this module and the ids removed since, and names that export as its
    base, for :meth:`ServingEmbedding.apply_delta`. On ps tasks the rows are gathered from
    every ps task (call it from one process: each export moves the chain). The export chain
    is separate from delta checkpoints': exporting moves no checkpoint save point.

    Args:
        module: a ``unison.DynamicEmbedding`` (its rows here or on ps tasks).
        path: a directory that does not exist yet (one per export).
        delta: what changed since the previous export, instead of every row.

    Returns:
        The export's directory.

    Raises:
        TypeError: ``module`` is not a DynamicEmbedding.
        FileExistsError: ``path`` exists.
        ValueError: ``delta=True`` with no export before it in this table's life (a restarted
            job exports full first).

    tf.distribute equivalent: none; TFRA's ``save_to_file_system`` of a table's keys and
    values, with no incremental export.
    """
    if not isinstance(module, DynamicEmbedding):
        raise TypeError(f"export_for_serving: `module` must be a unison.DynamicEmbedding, got "
                        f"{type(module).__name__}; fix: pass the embedding module itself (e.g. model.embedding)")
    target = Path(path)
    if target.exists():  # before the chain moves
        raise FileExistsError(f"export_for_serving: {str(target)!r} exists; a serving export is written once (a "
                              f"server may be reading it); fix: pass a new path for each export")
    export: dict[str, Any] = module.table.serving_export(bool(delta))
    return write_export(target, export, module.mode)
