"""Checks of what a dynamic table is given: ids, and exports to import (errors name the field and the fix)."""

from __future__ import annotations

from typing import Any

import torch

from unison._embeddings.tables.admission_policies import AdmissionPolicy
from unison._embeddings.tables.eviction import EvictionPolicy
from unison._embeddings.tables.initializers import Initializer

__all__ = ["check_table_arguments", "checked_ids", "checked_meta", "dtype_from_name", "EXPORT_KEYS", "META_KEYS",
           "POLICY_KEYS"]

EXPORT_KEYS = ("ids", "rows", "state", "counts", "last_seen", "meta")
POLICY_KEYS = ("idle_seconds", "pending_counts")
"""Optional parts of an export, present when the table's policies keep them: per row, seconds since its
last touch (a time to live in seconds); the admission sketch's counters of ids without a row."""
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
        raise ValueError(f"not a LocalTable export: needs keys {EXPORT_KEYS}, got "
                         f"{sorted(export) if isinstance(export, dict) else type(export).__name__}")
    meta: dict[str, Any] = export["meta"]
    missing = [key for key in META_KEYS if key not in meta]
    if missing:
        raise ValueError(f"LocalTable export meta lacks {missing}; fix: pass what LocalTable.export() returned")
    ids, n = export["ids"], export["ids"].numel()
    if ids.dtype != torch.int64 or ids.dim() != 1 or torch.unique(ids).numel() != n:
        raise ValueError(f"LocalTable export `ids` must be distinct int64 in a 1-D tensor, got {ids.dtype} "
                         f"shape {tuple(ids.shape)} with {n - torch.unique(ids).numel()} duplicates")
    shapes = {"rows": (n, meta["embedding_dim"]), "counts": (n,), "last_seen": (n,)}
    if "idle_seconds" in export:
        shapes["idle_seconds"] = (n,)
    pending = export.get("pending_counts")
    if pending is not None and (not isinstance(pending, torch.Tensor) or pending.dim() != 2):
        raise ValueError(f"LocalTable export `pending_counts` must be a [depth, width] tensor, got {pending!r:.80}")
    for key, shape in shapes.items():
        if tuple(export[key].shape) != shape:
            raise ValueError(f"LocalTable export `{key}` has shape {tuple(export[key].shape)}, expected {shape}")
    for name, values in export["state"].items():
        if values.dim() != 2 or values.shape[0] != n or name not in meta["state_init"]:
            raise ValueError(f"LocalTable export state {name!r} must be [{n}, columns] with an initial value in "
                             f"meta['state_init'], got shape {tuple(values.shape)}")
    return meta


def check_table_arguments(
    owner: str, embedding_dim: Any, dtype: Any, initializer: Any, seed: Any, eviction: Any, admission: Any = None
) -> None:
    """Raises naming ``owner``, the field and the fix for what a table is made from."""
    if isinstance(embedding_dim, bool) or not isinstance(embedding_dim, int) or embedding_dim < 1:
        raise ValueError(f"{owner}: `embedding_dim` must be an int >= 1, got {embedding_dim!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"{owner}: `dtype` must be a floating torch dtype, got {dtype!r}")
    if initializer is not None and not isinstance(initializer, Initializer):
        raise TypeError(f"{owner}: `initializer` must be an Initializer (e.g. uniform(-0.05, 0.05)), "
                        f"got {initializer!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"{owner}: `seed` must be an int, got {seed!r}")
    if eviction is not None and not isinstance(eviction, EvictionPolicy):
        raise TypeError(f"{owner}: `eviction` must be an EvictionPolicy (e.g. EvictUnseen(100)) or None, "
                        f"got {eviction!r}")
    if admission is not None and not isinstance(admission, AdmissionPolicy):
        raise TypeError(f"{owner}: `admission` must be an AdmissionPolicy (e.g. unison.embeddings.AdmitAfter(2)) or "
                        f"None, got {admission!r}")
