"""Process-wide hooks that make plain PyTorch code distribution-aware.

Two PyTorch extension points are used, installed once on first use of a strategy:
- module parameter- and buffer-registration hooks, so parameters of modules built inside
  ``strategy.scope()`` become distributed variables (or move to the strategy's device)
  and, with several local replicas, buffers (BatchNorm statistics) become per-replica
  SyncOnReadVariables instead of tensors that replica threads would update at once;
- optimizer step pre/post hooks, so ``opt.step()`` on a model of a strategy first
  waits for / performs the gradient aggregation that strategy needs.
Optimizers whose parameters belong to no strategy pay one attribute lookup per step.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn
from torch.optim import optimizer as torch_optimizer

from unison._state import STATE

__all__ = ["install_hooks", "SYNC_ATTRIBUTE"]

SYNC_ATTRIBUTE = "_unison_gradient_sync"


def _on_parameter_registered(module: nn.Module, name: str, param: Any) -> Any:
    entry = STATE.top()
    if param is None or entry is None or entry.replica_context is not None:
        return None
    extended = entry.strategy.extended
    if extended._is_default:
        return None
    replacement = extended._c.variable_policy.wrap_parameter(param, name)
    tracked = replacement if replacement is not None else param
    extended._track(tracked)
    return replacement


def _on_buffer_registered(module: nn.Module, name: str, buffer: Any) -> Any:
    entry = STATE.top()
    if buffer is None or entry is None or entry.replica_context is not None:
        return None
    extended = entry.strategy.extended
    if extended._is_default:
        return None
    wrap = getattr(extended._c.variable_policy, "wrap_buffer", None)
    replacement = wrap(buffer, name) if wrap is not None else None
    # tracked like parameters: across workers they start from the chief's values too
    extended._track(replacement if replacement is not None else buffer)
    return replacement


def _gradient_sync_of(optimizer: torch.optim.Optimizer) -> Any:
    for group in optimizer.param_groups:
        for param in group["params"]:
            return getattr(param, SYNC_ATTRIBUTE, None)
    return None


def _on_step_pre(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> Any:
    sync = _gradient_sync_of(optimizer)
    return None if sync is None else sync.pre_step(optimizer, args, kwargs)


def _on_step_post(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    sync = _gradient_sync_of(optimizer)
    if sync is not None:
        sync.post_step(optimizer)


class _Installer:
    """Installs the hooks once per process (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done = False

    def __call__(self) -> None:
        if self._done:
            return
        with self._lock:
            if self._done:
                return
            nn.modules.module.register_module_parameter_registration_hook(_on_parameter_registered)
            nn.modules.module.register_module_buffer_registration_hook(_on_buffer_registered)
            torch_optimizer.register_optimizer_step_pre_hook(_on_step_pre)
            torch_optimizer.register_optimizer_step_post_hook(_on_step_post)
            self._done = True


install_hooks = _Installer()
