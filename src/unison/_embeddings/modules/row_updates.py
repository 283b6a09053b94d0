"""How an optimizer's ``step()`` trains the rows of the ``DynamicEmbedding`` modules it holds.

Rows are not parameters a ``torch.optim`` optimizer can hold (they come and go): each
module registers one empty parameter, ``weight``, as a handle. This module is one owner of
the process's optimizer step hook (``_interpose/optimizer_hooks.py``): once per optimizer and
set of parameters its planner finds the handles among the param groups; at each step each
module then applies its recorded row gradients with the row optimizer that equals its
group's (:func:`row_optimizer_for`).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from unison._embeddings.optim.from_torch import row_optimizer_for
from unison._interpose.optimizer_hooks import StepWork, add_step_planner

if TYPE_CHECKING:
    from unison._embeddings.modules.dynamic_embedding import DynamicEmbedding

__all__ = ["install_row_updates", "register_table_module"]

_OWNER = WeakIdKeyDictionary()
"""Each module's ``weight`` handle -> a weak reference to the module (a dropped model leaves)."""

def register_table_module(module: DynamicEmbedding) -> None:
    """Makes ``module.weight`` a handle: an optimizer holding it trains the module's rows."""
    _OWNER[module.weight] = weakref.ref(module)


def _plan_rows(optimizer: torch.optim.Optimizer) -> StepWork | None:
    """The row updates at ``optimizer``'s steps: None unless it holds some module's handle."""
    found = [(p, group) for group in optimizer.param_groups for p in group["params"] if p in _OWNER]
    if not found:
        return None

    def apply_rows_before_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict[str, Any]) -> None:
        modules = [(module, group) for handle, group in found if (module := _OWNER[handle]()) is not None]
        # every module's row optimizer first: a refused setting raises before any row (or parameter) moves
        updates = [(module, row_optimizer_for(optimizer, group, row_wise=module.row_wise_adagrad))
                   for module, group in modules]
        for module, row_optimizer in updates:
            module.apply_row_gradients(row_optimizer)

    return StepWork(pre=apply_rows_before_step)


def install_row_updates() -> None:
    """Makes ``opt.step()`` train the rows of the modules it holds (once; ``_interpose/optimizer_hooks.py``):
    before every other owner's work at the step, so a refused row optimizer changes nothing."""
    add_step_planner(_plan_rows, first=True)
