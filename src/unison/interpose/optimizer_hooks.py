"""The changes unison makes to ``torch.optim.Optimizer``: global step hooks and state-dict wrappers.

Each is installed with its owner's handlers, which hold the behaviour:

- the gradient synchroniser's step hooks (``gradient_sync/step_hooks.py``): ``opt.step()``
  on a strategy's parameters first finishes their gradient sync, with no optimizer
  wrapper. The pre-hook may return ``(args, kwargs)`` whose first argument is another
  optimizer: under a multi-replica strategy a replica's step then runs on its shadow
  optimizer (torch calls ``step(*args, **kwargs)`` with what a pre-hook returns);
- the row updates of ``DynamicEmbedding`` (``ps/dynamic_embedding.py``): rows are not
  parameters an optimizer can hold, so a step pre-hook applies their gradients;
- the ps optimizer-state wrappers (``ps/optimizer_state.py``): the coordinator's optimizer
  state lives on the ps tasks, and ``state_dict`` / ``load_state_dict`` fetch and place it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.optim import optimizer as torch_optimizer

from unison.interpose.registry import Interposition

__all__ = ["optimizer_state_wrappers", "row_update_hook", "sync_step_hooks"]

StepHook = Callable[[torch.optim.Optimizer, tuple, dict], Any]
MethodWrapper = Callable[[Callable[..., Any]], Callable[..., Any]]


def _register_step_hooks(pre: StepHook, post: StepHook) -> None:
    torch_optimizer.register_optimizer_step_pre_hook(pre)
    torch_optimizer.register_optimizer_step_post_hook(post)


sync_step_hooks = Interposition(
    "global optimizer step pre/post hooks", "torch.optim.Optimizer (every instance)",
    "opt.step() on a strategy's parameters first finishes their gradient sync (no optimizer wrapper); "
    "a replica's step is redirected to its shadow optimizer by the pre-hook's returned arguments",
    _register_step_hooks)


def _register_row_updates(pre: StepHook) -> None:
    handle = torch_optimizer.register_optimizer_step_pre_hook(pre)
    # First of the global pre-hooks, whenever installed: the row update is chosen (or refused) before a
    # gradient sync hook pushes or applies any dense gradient, so a refused optimizer changes nothing.
    hooks = torch_optimizer._global_optimizer_pre_hooks
    others = [(key, hook) for key, hook in hooks.items() if key != handle.id]
    hooks.clear()
    hooks[handle.id] = pre
    hooks.update(others)


row_update_hook = Interposition(
    "a global optimizer step pre-hook, run first, that applies DynamicEmbedding row gradients",
    "torch.optim.Optimizer (all instances)",
    "rows are not parameters an optimizer can hold; the optimizer that holds a module's weight handle "
    "updates the rows its batches touched, with its own hyper-parameters, and refuses one whose rule no "
    "row update equals before any gradient sync moves a dense parameter",
    _register_row_updates)


def _wrap_state_methods(state_dict: MethodWrapper, load_state_dict: MethodWrapper) -> None:
    optimizer = torch.optim.Optimizer
    optimizer.state_dict = state_dict(optimizer.state_dict)  # type: ignore[method-assign]
    optimizer.load_state_dict = load_state_dict(optimizer.load_state_dict)  # type: ignore[method-assign]


optimizer_state_wrappers = Interposition(
    "Optimizer.state_dict/load_state_dict wrappers", "torch.optim.Optimizer (the class)",
    "the coordinator's optimizer state lives on the ps tasks; a checkpoint must hold it", _wrap_state_methods)
