"""The row update that equals a ``torch.optim`` optimizer's on a sparse gradient.

A ``DynamicEmbedding``'s rows are trained by the optimizer that holds the module's handle:
its class and param group pick a row optimizer here (``SGD`` without momentum, weight decay
or maximize: ``RowSGD``; ``Adagrad`` without ``lr_decay`` or weight decay: ``RowAdagrad``, or
``RowWiseAdagrad`` when the module asks for one accumulator per row). Anything else is
refused with the fix, so a row never moves by a rule that differs from the optimizer's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from unison.embeddings.optim.row_optimizers import RowAdagrad, RowOptimizer, RowSGD, RowWiseAdagrad

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
    name = type(optimizer).__name__
    if plain_sgd(type(optimizer), group):
        return RowSGD(lr=float(group["lr"]))
    if type(optimizer) is torch.optim.Adagrad:
        if not (group.get("lr_decay", 0) or group.get("weight_decay", 0) or group.get("maximize", False)):
            if row_wise:
                return RowWiseAdagrad(lr=float(group["lr"]), eps=group["eps"],
                                      initial_accumulator_value=group["initial_accumulator_value"])
            return RowAdagrad(lr=float(group["lr"]), initial_accumulator_value=group["initial_accumulator_value"],
                              eps=group["eps"])
    raise ValueError(
        f"DynamicEmbedding rows cannot be trained by {name} with "
        f"{dict((k, v) for k, v in group.items() if k != 'params')}: "
        f"rows train with torch.optim.SGD (no momentum, weight decay or maximize) or torch.optim.Adagrad (no lr_decay "
        f"or weight decay); put the module's parameters in a param group (or optimizer) of their own with one of those")
