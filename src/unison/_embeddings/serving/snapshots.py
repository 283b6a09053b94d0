"""The serving snapshot layout: a directory of numbered snapshots, each a model's tables and dense state.

Online training publishes the model it is training every few seconds for a serving
process that follows it (``exporter.ServingExporter`` writes, ``follower.ServingFollower``
reads). One snapshot holds every table's serving export and the dense layers at one
moment, so a reader takes them together::

    <root>/000000/snapshot.json              {"format": "unison.serving_snapshot", "version": 1,
                                              "number": 0, "kind": "full" | "delta", "chain": 0,
                                              "base": null | <number of the snapshot it follows>,
                                              "began": <unix time the export began>, "seconds": ...,
                                              "embeddings": ["table", ...], "dense": "dense.pt" | null,
                                              "info": {...}}
    <root>/000000/embeddings/<name>/         one ``export_for_serving`` directory per table
    <root>/000000/dense.pt                   the dense state_dict (tensors only: weights_only loads it)
    <root>/.000001.<pid>.<hex>.tmp/          a snapshot being written: readers ignore it

A snapshot is written under a temporary name and renamed into place (one ``rename`` of a
directory, atomic on POSIX file systems), so a numbered directory is always whole; the
same holds for removal (renamed away, then deleted). ``chain`` is the number of the full
snapshot a delta's chain starts from: a reader at any snapshot of that chain applies the
later deltas in order; a reader elsewhere loads the newest full snapshot first.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import Any

from unison._durable import fsync_directory

__all__ = ["FORMAT", "VERSION", "SnapshotMeta", "snapshot_path", "list_snapshots", "read_meta", "temporary_path",
           "write_meta", "publish", "remove", "check_table_name"]

FORMAT = "unison.serving_snapshot"
VERSION = 1
_NUMBERED = re.compile(r"\d+")
_TABLE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


@dataclasses.dataclass(frozen=True)
class SnapshotMeta:
    """What ``snapshot.json`` says of one snapshot (see the module for the fields)."""

    number: int
    kind: str
    chain: int
    base: int | None
    began: float
    seconds: float
    embeddings: tuple[str, ...]
    dense: str | None
    info: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, **dataclasses.asdict(self), "embeddings": list(self.embeddings)}


def snapshot_path(root: Path, number: int) -> Path:
    """Where snapshot ``number`` lives under ``root``."""
    return root / f"{number:06d}"


def list_snapshots(root: Path) -> list[int]:
    """The numbers of the whole snapshots under ``root``, ascending (temporary directories are not listed)."""
    try:
        names = [entry.name for entry in os.scandir(root) if entry.is_dir()]
    except FileNotFoundError:
        return []
    return sorted(int(name) for name in names if _NUMBERED.fullmatch(name))


def read_meta(root: Path, number: int) -> SnapshotMeta:
    """Snapshot ``number``'s ``snapshot.json``.

    Raises:
        ValueError: no ``snapshot.json`` in a numbered directory, another format or version,
            or fields that do not fit (the directory was not written by a ``ServingExporter``,
            or was damaged).
    """
    path = snapshot_path(root, number) / "snapshot.json"
    where = f"serving snapshot {str(path.parent)!r}"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{where} has no snapshot.json: it is damaged or was not written by "
                         f"unison.embeddings.ServingExporter; fix: remove it (a snapshot directory is "
                         f"only ever renamed into place whole)") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: snapshot.json is not JSON ({error}); the snapshot is damaged: remove it") from error
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION:
        seen = (data.get("format"), data.get("version")) if isinstance(data, dict) else data
        raise ValueError(f"{where} is format {seen!r}, expected {FORMAT!r} version {VERSION}; fix: follow a "
                         f"directory written by this unison version's ServingExporter")
    try:
        meta = SnapshotMeta(number=int(data["number"]), kind=str(data["kind"]), chain=int(data["chain"]),
                            base=None if data["base"] is None else int(data["base"]), began=float(data["began"]),
                            seconds=float(data["seconds"]), embeddings=tuple(str(n) for n in data["embeddings"]),
                            dense=None if data["dense"] is None else str(data["dense"]), info=dict(data["info"]))
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{where}: snapshot.json lacks or garbles field {error}; the snapshot is damaged: "
                         f"remove it") from error
    if meta.number != number or meta.kind not in ("full", "delta") or (meta.kind == "full") != (meta.base is None):
        raise ValueError(f"{where}: snapshot.json says number {meta.number}, kind {meta.kind!r}, base {meta.base} "
                         f"in directory {number:06d}; the snapshot is damaged: remove it")
    return meta


def temporary_path(root: Path, number: int) -> Path:
    """A fresh hidden directory name under ``root`` to write snapshot ``number`` in."""
    return root / f".{number:06d}.{os.getpid()}.{secrets.token_hex(4)}.tmp"


def write_meta(directory: Path, meta: SnapshotMeta) -> None:
    """``snapshot.json`` in ``directory``, flushed to disk."""
    with open(directory / "snapshot.json", "w") as handle:
        json.dump(meta.to_json(), handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())


def publish(temporary: Path, root: Path, number: int) -> Path:
    """Renames a written snapshot into place as ``number``; returns its path.

    Raises:
        FileExistsError: snapshot ``number`` exists (two exporters on one root).
    """
    target = snapshot_path(root, number)
    if target.exists():
        raise FileExistsError(f"ServingExporter: snapshot {str(target)!r} exists: another exporter writes to "
                              f"{str(root)!r}; fix: give each training job its own root")
    os.rename(temporary, target)
    fsync_directory(root)
    return target


def remove(root: Path, number: int) -> None:
    """Removes snapshot ``number``: renamed to a hidden name first, so no reader sees half of it."""
    hidden = root / f".{number:06d}.{secrets.token_hex(4)}.removed"
    try:
        os.rename(snapshot_path(root, number), hidden)
    except FileNotFoundError:
        return
    shutil.rmtree(hidden, ignore_errors=True)


def check_table_name(name: object, where: str) -> str:
    """``name`` if it can name a table's directory in a snapshot, else the error with the fix."""
    if not isinstance(name, str) or not _TABLE_NAME.fullmatch(name):
        raise ValueError(f"{where}: table name {name!r} must be a non-empty str of letters, digits, '_', '.' and "
                         f"'-' not starting with '.' or '-' (it names a directory); fix: e.g. 'user' or 'items'")
    return name

