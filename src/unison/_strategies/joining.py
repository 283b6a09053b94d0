"""A parameter made by any route joins the strategy of the parameter it copies or replaces.

Registration in ``scope()`` (``scope_hooks.py``) sees the parameters a module builds.
Three everyday routes make parameters without that registration, or outside the scope:

- ``copy.deepcopy`` of a module (``nn.TransformerEncoder`` clones its layer that way;
  so do EMA copies and teacher/student setups): the copy's ``_parameters`` are rebuilt
  from each parameter's ``__deepcopy__``, and no module hook runs. A distributed
  variable copies itself into a new variable of its strategy (``MirroredVariable`` and
  the ps variables do that in ``__deepcopy__``); a plain parameter of a multi-worker
  strategy (one device per worker) is marked with its gradient synchroniser, and the copy
  gets the same one (:func:`copy_parameter`, installed as ``nn.Parameter.__deepcopy__``).
- Replacing a parameter of a strategy's module outside the scope
  (``load_state_dict(..., assign=True)``, ``module.weight = nn.Parameter(t)``): the new
  parameter takes the old one's strategy (:func:`join_like`).
- Anything else (a module built outside the scope) stays plain; an optimizer that
  mixes such parameters with a strategy's, or steps them in a multi-replica run, is
  refused at its first step (``_gradient_sync/step_hooks.py``).

Without this, the workers' copies of a 2-layer TransformerEncoder parted by 2e-2 within
two steps, silently (their gradients were never all-reduced), and under
MirroredStrategy both replica threads trained one plain tensor. TensorFlow's
``DistributedVariable.__deepcopy__`` makes the same choice: the copy stays a variable of
the original's strategy, wherever it is taken, except inside another strategy's scope.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from unison._gradient_sync.step_hooks import attach, sync_of
from unison._interpose.module_hooks import ORIGINAL_PARAMETER_DEEPCOPY, parameter_copy_hook
from unison._state import STATE
from unison._values.variables import DistributedVariable

__all__ = ["copy_parameter", "install_copy_hook", "join_like"]

def _outside_replicas() -> bool:
    """Whether this thread is in cross-replica context (or in no strategy at all)."""
    entry = STATE.top()
    return entry is None or entry.replica_context is None


def _join_sync(param: torch.Tensor, sync: Any) -> None:
    """Gives ``param`` the gradient synchroniser ``sync`` (a plain parameter of a multi-worker strategy)."""
    if sync_of(param) is sync:
        return
    attach(param, sync)
    sync.register(param)


def join_like(new: torch.Tensor, old: Any, name: str, kind: str) -> torch.Tensor | None:
    """What ``new``, replacing ``old`` (a parameter or buffer of a module), becomes: a
    variable of ``old``'s strategy, ``new`` itself given ``old``'s synchroniser, or None
    when ``old`` belongs to no strategy (or this thread runs a replica)."""
    if old is None or old is new or not _outside_replicas():
        return None
    if isinstance(old, DistributedVariable) and old.distribute_strategy is not None:
        extended = old.distribute_strategy.extended
        return extended.create_parameter(new, name) if kind == "parameter" else extended.create_buffer(new, name)
    sync = sync_of(old)
    if kind == "parameter" and sync is not None:
        _join_sync(new, sync)
    return None


def copy_parameter(param: nn.Parameter, memo: dict) -> nn.Parameter:
    """``nn.Parameter.__deepcopy__``, plus: a copy of a parameter that a multi-worker
    strategy synchronises is synchronised by it too (workers' copies stay equal)."""
    copied = ORIGINAL_PARAMETER_DEEPCOPY(param, memo)
    sync = sync_of(param)
    if sync is not None and _outside_replicas():
        _join_sync(copied, sync)
    return copied


def install_copy_hook() -> None:
    """Makes ``copy_parameter`` torch's ``nn.Parameter.__deepcopy__`` (once; ``_interpose/module_hooks.py``)."""
    parameter_copy_hook(copy=copy_parameter)
