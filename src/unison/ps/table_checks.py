"""Checks of what a dynamic table is given: ids, and exports to import (errors name the field and the fix)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["checked_ids", "checked_meta", "dtype_from_name", "EXPORT_KEYS", "META_KEYS"]

EXPORT_KEYS = ("ids", "rows", "state", "counts", "last_seen", "meta")
META_KEYS = ("embedding_dim", "dtype", "seed", "step", "initializer", "state_init")


def checked_ids(ids: Any, where: str) -> torch.Tensor:
    """Ids as an int64 CPU tensor, or an error that names the call and the fix."""
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{where}: `ids` must be an integer torch.Tensor, got {type(ids).__name__}")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"{where}: `ids` must be an integer tensor, got dtype {ids.dtype}; fix: pass ids.long()")
    if ids.device.type != "cpu":
        raise ValueError(f"{where}: `ids` must be on the CPU, got device {ids.device}; fix: pass ids.cpu()")
    return ids.to(torch.int64)


def dtype_from_name(name: str) -> torch.dtype:
    """The dtype an export's meta names (``"torch.float32"``)."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"export meta names dtype {name!r}, which is not a torch dtype")
    return dtype


def checked_meta(export: Any) -> dict[str, Any]:
    """An export's meta after checking that its parts fit together."""
    if not isinstance(export, dict) or any(key not in export for key in EXPORT_KEYS):
        raise ValueError(f"not a DynamicTable export: needs keys {EXPORT_KEYS}, got "
                         f"{sorted(export) if isinstance(export, dict) else type(export).__name__}")
    meta: dict[str, Any] = export["meta"]
    missing = [key for key in META_KEYS if key not in meta]
    if missing:
        raise ValueError(f"DynamicTable export meta lacks {missing}; fix: pass what DynamicTable.export() returned")
    ids, n = export["ids"], export["ids"].numel()
    if ids.dtype != torch.int64 or ids.dim() != 1 or torch.unique(ids).numel() != n:
        raise ValueError(f"DynamicTable export `ids` must be distinct int64 in a 1-D tensor, got {ids.dtype} "
                         f"shape {tuple(ids.shape)} with {n - torch.unique(ids).numel()} duplicates")
    shapes = {"rows": (n, meta["embedding_dim"]), "counts": (n,), "last_seen": (n,)}
    for key, shape in shapes.items():
        if tuple(export[key].shape) != shape:
            raise ValueError(f"DynamicTable export `{key}` has shape {tuple(export[key].shape)}, expected {shape}")
    for name, values in export["state"].items():
        if values.dim() != 2 or values.shape[0] != n or name not in meta["state_init"]:
            raise ValueError(f"DynamicTable export state {name!r} must be [{n}, columns] with an initial value in "
                             f"meta['state_init'], got shape {tuple(values.shape)}")
    return meta
