"""Durable renames: a file or directory written under a temporary name, renamed into place, survives a crash
only once its parent directory's entries are on disk too.

Shared by the checkpoint files (``_checkpoint.files``) and the serving exports
(``_embeddings.serving``); it sits at the bottom layer so a serving process that imports
no training code can use it.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["fsync_directory"]


def fsync_directory(directory: str | os.PathLike[str]) -> None:
    """Flushes ``directory``'s entries (a rename into it) to disk, where the platform can."""
    try:
        fd = os.open(Path(directory), os.O_RDONLY)
    except OSError:  # pragma: no cover - not every platform opens directories
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some file systems refuse
        pass
    finally:
        os.close(fd)
