"""The serving export format: a directory with a small JSON manifest and raw little-endian arrays.

An export is a directory (written under a temporary name, fsynced, then renamed into place,
so a reader never sees half of one)::

    <path>/manifest.json   {"format": "unison.serving_embedding", "version": 1,
                            "kind": "full" | "delta", "export_id": "<hex>", "number": 0, 1, ...,
                            "base": null | <number of the export it follows>,
                            "embedding_dim": 16, "dtype": "float32", "mode": null | "sum" | "mean",
                            "arrays": {"ids": {"file": "ids.bin", "dtype": "int64", "shape": [n]},
                                       "rows": {"file": "rows.bin", "dtype": "float32", "shape": [n, 16]},
                                       "removed": {"file": "removed.bin", "dtype": "int64", "shape": [k]}}}
    <path>/ids.bin         n int64 ids, ascending
    <path>/rows.bin        their rows, C order
    <path>/removed.bin     ids to drop (a delta's tombstones; empty in a full export)

One format for both kinds: a full export is the chain's number 0 with every row and
nothing removed; a delta export ``number`` holds the rows made or changed since export
``base`` and the ids removed since. Raw arrays rather than ``torch.save``: a serving
system in any language reads them with the manifest alone (``numpy.fromfile``, ``mmap``, a
C++ ``fread``), loading one runs no unpickling, and the rows of a large table can be
memory-mapped. The byte order is little-endian (every platform torch ships for).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from unison._durable import fsync_directory

__all__ = ["FORMAT", "VERSION", "write_export", "read_export"]

FORMAT = "unison.serving_embedding"
VERSION = 1
_INTEGER = {"int64": torch.int64}
_FLOATING = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
             "bfloat16": torch.bfloat16}


def _check_byte_order() -> None:
    if sys.byteorder != "little":  # pragma: no cover - torch ships for little-endian platforms only
        raise RuntimeError("unison's serving export is little-endian; this machine is big-endian")


def write_export(path: str | os.PathLike[str], export: dict[str, Any], mode: str | None) -> Path:
    """Writes a table's ``serving_export()`` as a directory at ``path`` (atomically); returns it.

    Raises:
        FileExistsError: ``path`` exists (an export is never overwritten: a server may be reading it).
    """
    _check_byte_order()
    target = Path(path)
    if target.exists():
        raise FileExistsError(f"export_for_serving: {str(target)!r} exists; a serving export is written once "
                              f"(a server may be reading it); fix: pass a new path for each export, e.g. "
                              f"exports/{{number:06d}}")
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.parent / f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    meta = export["meta"]
    rows = export["rows"].contiguous()
    dtype = str(rows.dtype).removeprefix("torch.")
    arrays = {"ids": ("int64", export["ids"]), "rows": (dtype, rows), "removed": ("int64", export["removed"])}
    manifest = {"format": FORMAT, "version": VERSION, "kind": "full" if meta["base"] is None else "delta",
                "export_id": meta["export_id"], "number": meta["number"], "base": meta["base"],
                "embedding_dim": meta["embedding_dim"], "dtype": dtype, "mode": mode,
                "arrays": {name: {"file": f"{name}.bin", "dtype": kind, "shape": list(tensor.shape)}
                           for name, (kind, tensor) in arrays.items()}}
    try:
        temporary.mkdir()
        for name, (_, tensor) in arrays.items():
            with open(temporary / f"{name}.bin", "wb") as handle:
                if tensor.numel():  # the tensor's own memory, no copy (the write releases the GIL)
                    handle.write(memoryview(tensor.contiguous().view(torch.uint8).numpy()))
                handle.flush()
                os.fsync(handle.fileno())
        with open(temporary / "manifest.json", "w") as handle:
            json.dump(manifest, handle, indent=1)
            handle.flush()
            os.fsync(handle.fileno())
        os.rename(temporary, target)
        fsync_directory(target.parent)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    return target


def read_export(path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The manifest and the arrays (``ids``, ``rows``, ``removed``) of an export directory.

    Raises:
        FileNotFoundError: no export at ``path``.
        ValueError: a manifest of another format or version, or arrays that do not match it.
    """
    _check_byte_order()
    directory = Path(path)
    manifest_path = directory / "manifest.json"
    if not manifest_path.is_file():
        raise FileNotFoundError(f"ServingEmbedding: no serving export at {str(directory)!r} (no manifest.json); "
                                f"fix: pass a directory that unison.embeddings.export_for_serving wrote")
    manifest = json.loads(manifest_path.read_text())
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise ValueError(f"ServingEmbedding: {str(manifest_path)!r} is format {manifest.get('format')!r} version "
                         f"{manifest.get('version')!r}, expected {FORMAT!r} version {VERSION}; fix: export with "
                         f"this unison version")
    tensors = {}
    for name in ("ids", "rows", "removed"):
        spec = manifest["arrays"][name]
        dtype = _INTEGER.get(spec["dtype"]) if name != "rows" else _FLOATING.get(spec["dtype"])
        if dtype is None:
            raise ValueError(f"ServingEmbedding: array {name!r} of {str(directory)!r} has dtype {spec['dtype']!r}, "
                             f"expected {'int64' if name != 'rows' else sorted(_FLOATING)}")
        data = (directory / spec["file"]).read_bytes()
        count = 1
        for size in spec["shape"]:
            count *= size
        expected = count * torch.empty(0, dtype=dtype).element_size()
        if len(data) != expected:
            raise ValueError(f"ServingEmbedding: {spec['file']!r} of {str(directory)!r} holds {len(data)} bytes, "
                             f"its manifest says {spec['shape']} {spec['dtype']} ({expected} bytes); the export is "
                             f"damaged: export again")
        flat = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype) if data else torch.zeros(0, dtype=dtype)
        tensors[name] = flat.reshape(spec["shape"])
    return manifest, tensors
