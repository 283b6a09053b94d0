"""Optimizer step hooks: ``opt.step()`` on a strategy's model first completes its gradient sync.

A parameter created in a strategy's scope is marked with that strategy's gradient
synchroniser in a side table (``attach``/``sync_of``, keyed weakly by the tensor's
identity; nothing is stashed on the tensor, so a pickled parameter carries none of it).
This module is one owner of the process's optimizer step hook (``_interpose/optimizer_hooks.py``):
once per optimizer and set of parameters its planner checks that one strategy owns them
all and names that synchroniser, whose ``pre_step`` finishes the reduction (and, with
several local replicas, redirects replica ``i`` to its own shadow optimizer) and whose
``post_step`` runs after. Optimizers whose parameters belong to no strategy pay one lookup
of their plan per step.
"""

from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

from unison._gradient_sync.contract import StepSync
from unison._interpose.optimizer_hooks import StepWork, add_step_planner
from unison._state import STATE
from unison._values.variables import DistributedVariable
from unison.errors import UsageError

__all__ = ["attach", "install_step_hooks", "sync_of"]

# parameter -> the gradient synchroniser of its strategy (weak in the parameter, by identity)
_SYNC_OF: WeakIdKeyDictionary = WeakIdKeyDictionary()



def attach(param: torch.Tensor, gradient_sync: StepSync) -> None:
    """Marks ``param`` as synchronised by ``gradient_sync`` (found again at ``opt.step()``)."""
    _SYNC_OF[param] = gradient_sync


def sync_of(param: torch.Tensor) -> StepSync | None:
    """The gradient synchroniser ``param`` was attached to, or None."""
    return _SYNC_OF.get(param)


def _gradient_sync_of(optimizer: torch.optim.Optimizer) -> StepSync | None:
    for group in optimizer.param_groups:
        for param in group["params"]:
            return _SYNC_OF.get(param)
    return None


def _owner_sync(param: torch.Tensor) -> StepSync | None:
    """The synchroniser of ``param``: attached, or its distributed variable's strategy's (``unison.Variable``)."""
    sync = _SYNC_OF.get(param)
    if sync is None and isinstance(param, DistributedVariable) and param.distribute_strategy is not None:
        sync = param.distribute_strategy.extended.components.gradient_sync
    return sync


def _param_count(optimizer: torch.optim.Optimizer) -> int:
    return sum(len(group["params"]) for group in optimizer.param_groups)


def _check_owners(optimizer: torch.optim.Optimizer) -> None:
    """Refuses a step whose parameters are not all synchronised by one strategy, or that steps
    unsynchronised parameters in a run of several replicas: their gradients would never be
    reduced, so replicas or workers would part silently."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    owners = [_owner_sync(p) for p in params]
    reference = next((owner for owner in owners if owner is not None), None)
    if reference is None:  # none is a strategy's: wrong only when stepped in a run of several replicas
        entry = STATE.top()
        strategy = entry.replica_context.strategy if entry is not None and entry.replica_context is not None else None
        if (strategy is None or strategy.extended.components.gradient_sync is None
                or strategy.num_replicas_in_sync == 1):
            return
        strays = list(range(len(params)))
        owner = f"{type(strategy).__name__} ({strategy.num_replicas_in_sync} replicas in sync)"
    else:
        strays = [k for k, owner in enumerate(owners) if owner is not reference]
        if not strays:
            return
        owner = ("the strategy of the optimizer's first parameter" if owners[0] is reference
                 else "the strategy of its other parameters")
    shown = ", ".join(f"#{k} {tuple(params[k].shape)}" for k in strays[:3]) + (" ..." if len(strays) > 3 else "")
    raise UsageError(
        f"opt.step(): {len(strays)} of the optimizer's {len(params)} parameters ({shown}) are not synchronised "
        f"by {owner}: their gradients would never be reduced and the replicas would part silently. They were "
        f"made outside `strategy.scope()` (a module built there, or a parameter added to a module after it); "
        f"build or add them inside `with strategy.scope():` (deep copies and parameters replaced with "
        f"load_state_dict(..., assign=True) join the original's strategy by themselves)"
    )


def _plan_step(optimizer: torch.optim.Optimizer) -> StepWork | None:
    """What the gradient sync does at ``optimizer``'s steps: refuses parameters of no or another
    strategy; else its synchroniser's ``pre_step`` and ``post_step`` (None where it has none)."""
    _check_owners(optimizer)
    sync = _gradient_sync_of(optimizer)
    return None if sync is None else StepWork(pre=sync.pre_step, post=sync.post_step)


def install_step_hooks() -> None:
    """Makes ``opt.step()`` find the gradient sync (once; ``_interpose/optimizer_hooks.py``).

    ``strategy.run`` calls it every step: once installed it costs one attribute read."""
    if not _INSTALLED:
        add_step_planner(_plan_step)
        _INSTALLED.append(True)


_INSTALLED: list[bool] = []
