"""How an optimizer's ``step()`` trains the rows of the ``DynamicEmbedding`` modules it holds.

Rows are not parameters a ``torch.optim`` optimizer can hold (they come and go): each
module registers one empty parameter, ``weight``, as a handle. The process-wide optimizer
step pre-hook installed here (once; ``interpose/optimizer_hooks.py``) finds the handles
among the optimizer's param groups and has each module apply its recorded row gradients
with the row optimizer that equals that group's (:func:`row_optimizer_for`).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from unison.embeddings.optim.from_torch import row_optimizer_for
from unison.interpose.optimizer_hooks import row_update_hook

if TYPE_CHECKING:
    from unison.embeddings.modules.dynamic_embedding import DynamicEmbedding

__all__ = ["install_row_updates", "register_table_module"]

_OWNER = WeakIdKeyDictionary()
"""Each module's ``weight`` handle -> a weak reference to the module (a dropped model leaves)."""

_HOLDERS: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int, list]] = weakref.WeakKeyDictionary()
"""Per optimizer: (how many param groups it had, its (handle, group) pairs), found once."""


def register_table_module(module: DynamicEmbedding) -> None:
    """Makes ``module.weight`` a handle: an optimizer holding it trains the module's rows."""
    _OWNER[module.weight] = weakref.ref(module)


def _handles_of(optimizer: torch.optim.Optimizer) -> list:
    groups = optimizer.param_groups
    known = _HOLDERS.get(optimizer)
    if known is not None and known[0] == len(groups):
        return known[1]
    found = [(p, group) for group in groups for p in group["params"] if p in _OWNER]
    _HOLDERS[optimizer] = (len(groups), found)
    return found


def _apply_rows_before_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict[str, Any]) -> None:
    modules = [(module, group) for handle, group in _handles_of(optimizer)
               if (module := _OWNER[handle]()) is not None]
    # every module's row optimizer first: a refused setting raises before any row (or parameter) moves
    updates = [(module, row_optimizer_for(optimizer, group, row_wise=module.row_wise_adagrad))
               for module, group in modules]
    for module, row_optimizer in updates:
        module.apply_row_gradients(row_optimizer)


def install_row_updates() -> None:
    """Installs the step pre-hook that applies row gradients (once; ``interpose/optimizer_hooks.py``)."""
    row_update_hook(pre=_apply_rows_before_step)
