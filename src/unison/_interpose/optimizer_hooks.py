"""The changes unison makes to ``torch.optim.Optimizer``: one step-hook dispatcher, an instance's
``zero_grad``, and state-dict wrappers.

- the step hooks (:data:`step_hooks`): ONE global step pre-hook for every owner that acts
  at ``opt.step()``: the gradient synchroniser (``_gradient_sync/step_hooks.py``:
  ``opt.step()`` on a strategy's parameters first finishes their gradient sync; under a
  multi-replica strategy the pre-hook's returned ``(args, kwargs)`` redirect a replica's
  step to its shadow optimizer) and the row updates of ``DynamicEmbedding``
  (``_embeddings/modules/row_updates.py``: rows are not parameters an optimizer can hold).
  Each owner registers a *planner* that says, once per optimizer and set of parameters,
  what it does at that optimizer's steps (:class:`StepWork`, or None); a step then costs
  one lookup of the optimizer's plan, and an optimizer no owner acts on does nothing
  more. The global post-hook is installed only once some plan has work after the step;
- the replica ``zero_grad`` (:data:`replica_zero_grad`): an optimizer over a multi-replica
  strategy's variables gets a ``zero_grad`` of its own (``_gradient_sync/replicas/replica_zero_grad.py``);
- the ps optimizer-state wrappers (``_ps/remote_variables/optimizer_state.py``): the
  coordinator's optimizer state lives on the ps tasks, and ``state_dict`` /
  ``load_state_dict`` fetch and place it.
"""

from __future__ import annotations

import dataclasses
import threading
import typing
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.optim import optimizer as torch_optimizer

from unison._interpose.registry import InstanceInterposition, Interposition

__all__ = ["StepWork", "add_step_planner", "optimizer_state_wrappers", "replica_zero_grad", "step_hooks",
           "step_post_hook"]

StepHook = Callable[[torch.optim.Optimizer, tuple, dict], Any]
MethodWrapper = Callable[[Callable[..., Any]], Callable[..., Any]]


@typing.final
@dataclasses.dataclass(frozen=True)
class StepWork:
    """What one owner does at each step of one optimizer.

    ``pre(optimizer, args, kwargs)`` runs before the step and may return new ``(args,
    kwargs)`` (torch then steps with them); ``post(optimizer)`` runs after it.
    """

    pre: StepHook | None = None
    post: Callable[[torch.optim.Optimizer], None] | None = None


StepPlanner = Callable[[torch.optim.Optimizer], "StepWork | None"]
"""An owner's answer, once per optimizer and set of parameters: what it does at its steps (or None)."""


@typing.final
@dataclasses.dataclass(frozen=True)
class _Plan:
    count: int  # the optimizer's parameters when planned: another count plans again
    pres: tuple[StepHook, ...]
    posts: tuple[Callable[[torch.optim.Optimizer], None], ...]


_PLANNERS: list[StepPlanner] = []
_PLANS: weakref.WeakKeyDictionary[torch.optim.Optimizer, _Plan] = weakref.WeakKeyDictionary()
_PLANNERS_LOCK = threading.Lock()


def _param_count(optimizer: torch.optim.Optimizer) -> int:
    groups = optimizer.param_groups
    if len(groups) == 1:
        return len(groups[0]["params"])
    return sum(len(group["params"]) for group in groups)


def _plan(optimizer: torch.optim.Optimizer, count: int) -> _Plan:
    works = [work for work in (planner(optimizer) for planner in tuple(_PLANNERS)) if work is not None]
    plan = _Plan(count, tuple(w.pre for w in works if w.pre is not None),
                 tuple(w.post for w in works if w.post is not None))
    if plan.posts:
        step_post_hook(post=_on_step_post)
    _PLANS[optimizer] = plan
    return plan


def _on_step_pre(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> Any:
    plan = _PLANS.get(optimizer)
    count = _param_count(optimizer)
    if plan is None or plan.count != count:
        plan = _plan(optimizer, count)
    result = None
    for pre in plan.pres:
        answer = pre(optimizer, args, kwargs)
        if answer is not None:
            result = answer
            args, kwargs = answer
    return result


def _on_step_post(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    plan = _PLANS.get(optimizer)
    if plan is not None:
        for post in plan.posts:
            post(optimizer)


def add_step_planner(planner: StepPlanner, *, first: bool = False) -> None:
    """Adds an owner's planner (once per owner) and installs the step pre-hook if it is not yet.

    An owner is added before the first step it acts on (when its first parameter or module
    is made); every optimizer then asks every owner again. ``first``: its work runs before
    every other owner's (the row updates: a refused row optimizer raises before any
    gradient sync moves a dense parameter)."""
    with _PLANNERS_LOCK:
        if planner not in _PLANNERS:
            _PLANNERS.insert(0 if first else len(_PLANNERS), planner)
            _PLANS.clear()
    step_hooks(pre=_on_step_pre)


def _register_pre_hook(pre: StepHook) -> None:
    torch_optimizer.register_optimizer_step_pre_hook(pre)


def _register_post_hook(post: StepHook) -> None:
    torch_optimizer.register_optimizer_step_post_hook(post)


step_hooks = Interposition(
    "one global optimizer step pre-hook, dispatching to the owners that act at opt.step()",
    "torch.optim.Optimizer (every instance)",
    "opt.step() on a strategy's parameters first finishes their gradient sync (a replica's step redirected to its "
    "shadow optimizer by the returned arguments), and DynamicEmbedding rows (not parameters an optimizer can hold) "
    "take their updates; one hook and one plan per optimizer, so a step no owner acts on costs one lookup",
    _register_pre_hook)

step_post_hook = Interposition(
    "a global optimizer step post-hook, once some optimizer's plan has work after its step",
    "torch.optim.Optimizer (every instance)",
    "a gradient synchroniser resumes after the step (e.g. a replica's shadow optimizer hands back); "
    "installed only where such a synchroniser steps",
    _register_post_hook)


def _replace_zero_grad(optimizer: torch.optim.Optimizer, zero_grad: Callable[..., None]) -> None:
    optimizer.zero_grad = zero_grad  # type: ignore[method-assign]


replica_zero_grad = InstanceInterposition(
    "an optimizer's own zero_grad, without a dispatch per parameter inside a replica",
    "torch.optim.Optimizer instances over a multi-replica strategy's variables (the instance attribute)",
    "the class's zero_grad reads and sets p.grad through each variable's __torch_function__: two dispatches "
    "per parameter per replica per step",
    _replace_zero_grad)


def _wrap_state_methods(state_dict: MethodWrapper, load_state_dict: MethodWrapper) -> None:
    optimizer = torch.optim.Optimizer
    optimizer.state_dict = state_dict(optimizer.state_dict)  # type: ignore[method-assign]
    optimizer.load_state_dict = load_state_dict(optimizer.load_state_dict)  # type: ignore[method-assign]


optimizer_state_wrappers = Interposition(
    "Optimizer.state_dict/load_state_dict wrappers", "torch.optim.Optimizer (the class)",
    "the coordinator's optimizer state lives on the ps tasks; a checkpoint must hold it", _wrap_state_methods)
