"""The row update that equals a ``torch.optim`` optimizer's on a sparse gradient.

A ``DynamicEmbedding``'s rows are trained by the optimizer that holds the module's handle:
its class and param group pick a row optimizer here (``SGD`` without momentum, weight decay
or maximize: ``RowSGD``; ``Adagrad`` without ``lr_decay`` or weight decay: ``RowAdagrad``, or
``RowWiseAdagrad`` when the module asks for one accumulator per row; ``SparseAdam``:
``RowSparseAdam``; ``unison.optim.Ftrl``: ``RowFtrl``). Anything else is refused with the
fix, so a row never moves by a rule that differs from the optimizer's. ``Adam`` and
``AdamW`` are refused naming ``SparseAdam``: their dense step would move every row, also
those the batch did not touch (their moments decay), which a table of rows made on first
touch cannot do and a sparse model does not want.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from unison._embeddings.optim.row_optimizers import (
    RowAdagrad,
    RowFtrl,
    RowOptimizer,
    RowSGD,
    RowSparseAdam,
    RowWiseAdagrad,
)
from unison._optim.ftrl import FTRL_FIELDS, Ftrl

__all__ = ["plain_sgd", "row_optimizer_for"]


def plain_sgd(cls: type, hyper: Mapping[str, Any]) -> bool:
    """Whether ``cls`` with group ``hyper`` is SGD without momentum, weight decay or maximize
    (a bare ``p -= lr * g``)."""
    return (cls is torch.optim.SGD and not hyper.get("momentum") and not hyper.get("weight_decay")
            and not hyper.get("maximize"))


def row_optimizer_for(
    optimizer: torch.optim.Optimizer, group: Mapping[str, Any], row_wise: bool = False
) -> RowOptimizer:
    """The row update that equals ``optimizer``'s on a sparse gradient, with ``group``'s hyper-parameters
    (``row_wise``: Adagrad with one accumulator per row instead).

    Raises:
        ValueError: for an optimizer (or a setting of one) whose sparse step no row update equals.
    """
    cls = type(optimizer)
    settings = {k: v for k, v in group.items() if k != "params"}
    if plain_sgd(cls, group):
        return RowSGD(lr=float(group["lr"]))
    if cls is torch.optim.Adagrad:
        if not (group.get("lr_decay", 0) or group.get("weight_decay", 0) or group.get("maximize", False)):
            if row_wise:
                return RowWiseAdagrad(lr=float(group["lr"]), eps=group["eps"],
                                      initial_accumulator_value=group["initial_accumulator_value"])
            return RowAdagrad(lr=float(group["lr"]), initial_accumulator_value=group["initial_accumulator_value"],
                              eps=group["eps"])
    if cls is torch.optim.SparseAdam:
        return RowSparseAdam(lr=float(group["lr"]), betas=tuple(group["betas"]), eps=group["eps"],
                             maximize=bool(group.get("maximize", False)))
    if cls is Ftrl:
        return RowFtrl(**{name: group[name] for name in FTRL_FIELDS})
    if cls in (torch.optim.Adam, torch.optim.AdamW):
        raise ValueError(
            f"DynamicEmbedding rows cannot be trained by {cls.__name__} with {settings}: its dense step would move "
            f"every row, also those the batch did not touch; fix: train the module's parameters with "
            f"torch.optim.SparseAdam (Adam on the touched rows only, as on nn.Embedding(sparse=True)) and keep "
            f"{cls.__name__} for the dense parameters, e.g. SparseAdam(emb.parameters(), lr=...) beside "
            f"{cls.__name__}(dense_parameters, lr=...)")
    raise ValueError(
        f"DynamicEmbedding rows cannot be trained by {cls.__name__} with {settings}: rows train with "
        f"torch.optim.SGD (no momentum, weight decay or maximize), torch.optim.Adagrad (no lr_decay or weight "
        f"decay), torch.optim.SparseAdam or unison.optim.Ftrl; put the module's parameters in a param group (or "
        f"optimizer) of their own with one of those")
