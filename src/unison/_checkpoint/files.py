"""Checkpoint files: written by the chief only, atomically, and cleaned up after a crash.

Every worker holds the same weights, so one copy is enough. ``atomic_save`` writes a
temporary file beside the target (``.<name>.<pid>.<random>.tmp``), fsyncs it, renames
it into place and fsyncs the directory, so a reader (or a restarted cluster) never
sees a half-written checkpoint, and a kill during a save leaves the previous one
loadable. Temporaries that a killed writer left behind are removed by the next save of
the same file. A full disk is reported with the path and the free space. The file gets
the mode the umask gives new files (``mkstemp`` alone would make it 0600).
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import Any

import torch

from unison._durable import fsync_directory
from unison._strategies.current import get_strategy
from unison.errors import CheckpointError

__all__ = ["save_checkpoint", "load_checkpoint", "atomic_save"]

_TEMPORARY = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)\.[0-9a-f]+\.tmp$")


def save_checkpoint(state: Any, path: str | os.PathLike[str], strategy: Any = None) -> bool:
    """Saves ``state`` with ``torch.save`` if this process should checkpoint.

    Args:
        state: what to save (model and optimizer ``state_dict()``s, the epoch, ...).
        path: the checkpoint file; its directory is created if needed.
        strategy: whose ``extended.should_checkpoint`` decides; default the current one.

    Returns:
        True if this process wrote the file (the chief), False otherwise.

    Raises:
        CheckpointError: if the disk is full (the previous checkpoint is kept).
    """
    strategy = strategy if strategy is not None else get_strategy()
    if not strategy.extended.should_checkpoint:
        return False
    atomic_save(state, path)
    return True


def atomic_save(state: Any, path: str | os.PathLike[str]) -> None:
    """Writes ``state`` to ``path`` atomically (temporary file, fsync, rename, fsync of the directory).

    Raises:
        CheckpointError: if the disk is full; the previous file at ``path`` is kept.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(target)
    temporary = target.parent / f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as to any new file
        with os.fdopen(fd, "wb") as handle:
            torch.save(state, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, target)
        fsync_directory(target.parent)
    except BaseException as exc:
        temporary.unlink(missing_ok=True)
        if _is_disk_full(exc, target.parent):
            free = shutil.disk_usage(target.parent).free
            raise CheckpointError(
                f"cannot write checkpoint {str(target)!r}: no space left on the device ({free} bytes free in "
                f"{str(target.parent)!r}); the previous checkpoint there is kept. Free some space or save elsewhere"
            ) from exc
        raise


def load_checkpoint(path: str | os.PathLike[str], map_location: Any = "cpu") -> Any:
    """Loads a checkpoint written by :func:`save_checkpoint` (on every worker).

    Raises:
        FileNotFoundError: naming the path, if there is no checkpoint there.
    """
    target = Path(path)
    if not target.is_file():
        raise FileNotFoundError(
            f"no checkpoint at {str(target)!r}: nothing was saved there yet; train first (save_checkpoint writes it "
            f"on the chief), or pass the path the chief saved to"
        )
    return torch.load(target, map_location=map_location, weights_only=False)


def _remove_stale_temporaries(target: Path) -> None:
    """Removes temporaries of ``target`` whose writer is gone (killed during an earlier save)."""
    try:
        names = os.listdir(target.parent)
    except OSError:
        return
    for name in names:
        match = _TEMPORARY.match(name)
        if match is None or match.group("name") != target.name:
            continue
        pid = int(match.group("pid"))
        if pid == os.getpid() or not _alive(pid):
            (target.parent / name).unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _is_disk_full(exc: BaseException, directory: Path) -> bool:
    """Whether a failed write ran out of space (torch's writer reports it as 'unexpected pos')."""
    for error in (exc, exc.__cause__, exc.__context__):
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
    if isinstance(exc, RuntimeError) and "unexpected pos" in str(exc):
        try:
            return shutil.disk_usage(directory).free < (64 << 20)
        except OSError:  # pragma: no cover
            return True
    return False
