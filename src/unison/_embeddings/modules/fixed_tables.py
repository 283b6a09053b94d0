"""Fixed-size embedding tables onto the ps tasks: ``on_ps(nn.Embedding(...))`` and a size threshold.

A model written with ``nn.Embedding``/``nn.EmbeddingBag`` keeps its tables replicated on
every worker under MultiWorkerMirrored-style training. ``on_ps(module)`` (the user marks
a table) and ``tables_on_ps(model, min_bytes)`` (a size threshold selects them) turn such
tables into ``DynamicEmbedding`` modules with ``num_embeddings`` set: the same rows
(ids ``0..n-1`` keep the module's values), the same ``IndexError`` for an id outside,
the same pooling; built in a ``HybridParameterServerStrategy``'s (or a
``ParameterServerStrategy``'s) scope, their rows live on the ps tasks and each worker
pulls only its batch's rows from then on. Under the hybrid strategy the chief's values
are the ones written (as MWMS starts every variable from the chief's), and every worker
waits for them.

What it cannot change: the module was built first, so its table was allocated and
initialised once in each process (a peak the size of the table). A table larger than a
worker's memory must be a ``DynamicEmbedding`` from the start.
Refused with the reason: ``padding_idx``, ``max_norm``, ``scale_grad_by_freq``, an
``EmbeddingBag`` with ``mode="max"`` or ``include_last_offset``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from unison._embeddings.modules.dynamic_embedding import DynamicEmbedding
from unison._embeddings.tables.initializers import normal
from unison._state import STATE

__all__ = ["on_ps", "tables_on_ps"]


def _refusal(module: nn.Module) -> str | None:
    """Why ``module`` cannot become a dynamic table, or None."""
    if not isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        return f"it is a {type(module).__name__}, not an nn.Embedding or nn.EmbeddingBag"
    for name in ("padding_idx", "max_norm"):
        if getattr(module, name, None) is not None:
            return f"its {name}={getattr(module, name)!r} has no row-table equivalent here"
    if getattr(module, "scale_grad_by_freq", False):
        return "scale_grad_by_freq=True has no row-table equivalent here"
    if isinstance(module, nn.EmbeddingBag):
        if module.mode not in ("sum", "mean"):
            return f"EmbeddingBag mode={module.mode!r}: rows pool by 'sum' or 'mean' only"
        if module.include_last_offset:
            return "include_last_offset=True: pass offsets without the last one"
    return None


def on_ps(module: nn.Module) -> DynamicEmbedding:
    """A ``DynamicEmbedding`` holding ``module``'s rows (ids ``0..num_embeddings-1``), for ``module``'s place.

    Example (in a HybridParameterServerStrategy's scope)::

        self.items = unison.embeddings.on_ps(nn.EmbeddingBag(5_000_000, 64, mode="sum"))

    Raises:
        TypeError: for a module that is not an ``nn.Embedding`` or ``nn.EmbeddingBag``.
        ValueError: for an option a row table cannot keep (see the module docstring).
    """
    reason = _refusal(module)
    if reason is not None:
        error = TypeError if not isinstance(module, (nn.Embedding, nn.EmbeddingBag)) else ValueError
        raise error(f"on_ps({type(module).__name__}): {reason}; fix: keep this table as it is, or build a "
                    f"unison.DynamicEmbedding directly")
    weight: torch.Tensor = module.weight  # type: ignore[assignment]
    with torch.no_grad():
        rows = torch.Tensor(weight).detach().to("cpu", copy=True)  # the plain values, whatever the variable type
    mode = module.mode if isinstance(module, nn.EmbeddingBag) else None
    table = DynamicEmbedding(rows.shape[1], mode=mode, num_embeddings=rows.shape[0], dtype=rows.dtype,
                             initializer=normal(0.0, 1.0))
    table.table.load(_export_of(rows, table))
    top = STATE.top()
    if top is not None and top.strategy is not None:
        top.strategy.extended.discard_pending(weight)  # not placed on a ps task nor broadcast: it is replaced
    return table


def tables_on_ps(model: nn.Module, min_bytes: int) -> list[str]:
    """Replaces, in place, every ``nn.Embedding``/``nn.EmbeddingBag`` of ``model`` whose table
    takes ``min_bytes`` or more by :func:`on_ps`'s ``DynamicEmbedding``; returns their names.

    Raises:
        ValueError: if ``min_bytes`` is not a non-negative int, or a selected table has an
            option a row table cannot keep.
    """
    if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
        raise ValueError(f"tables_on_ps: `min_bytes` must be an int >= 0, got {min_bytes!r}")
    chosen = [(name, module) for name, module in model.named_modules()
              if isinstance(module, (nn.Embedding, nn.EmbeddingBag))
              and module.weight.numel() * module.weight.element_size() >= min_bytes]
    for name, module in chosen:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        parent.register_module(child, on_ps(module))
    return [name for name, _ in chosen]


def _export_of(rows: torch.Tensor, table: DynamicEmbedding) -> dict[str, Any]:
    """The export of a table holding ``rows`` under ids ``0..n-1``, never looked up yet."""
    n = rows.shape[0]
    return {"ids": torch.arange(n, dtype=torch.int64), "rows": rows, "state": {},
            "counts": torch.zeros(n, dtype=torch.int64), "last_seen": torch.zeros(n, dtype=torch.int64),
            "meta": {"embedding_dim": rows.shape[1], "dtype": str(rows.dtype), "seed": 0, "step": 0,
                     "initializer": normal(0.0, 1.0).config(), "state_init": {}}}
