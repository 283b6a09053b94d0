"""Module registration hooks: parameters and buffers of modules built in ``scope()`` follow the strategy.

PyTorch's global parameter- and buffer-registration hooks are installed once per
process. Inside a (non-default) strategy's scope, in cross-replica context, a new
parameter or buffer is handed to ``strategy.extended.create_parameter`` /
``create_buffer``, whose variable policy decides what it becomes: a distributed
variable, a tensor moved to the strategy's device, or itself. Elsewhere the hooks
return at once. A module that gets a mirrored variable as a parameter reads it, in a
replica, as the replica's plain component (``values/replica_parameters.py``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from unison._once import Once
from unison._state import STATE
from unison.values.replica_parameters import resolve_in_replicas
from unison.values.variables import MirroredVariable

__all__ = ["install_scope_hooks"]


def _extended_in_scope() -> Any:
    entry = STATE.top()
    if entry is None or entry.replica_context is not None:
        return None
    extended = entry.strategy.extended
    return None if extended.components.is_default else extended


def _on_parameter_registered(module: nn.Module, name: str, param: Any) -> Any:
    extended = _extended_in_scope() if param is not None else None
    replacement = None if extended is None else extended.create_parameter(param, name)
    registered = param if replacement is None else replacement
    if isinstance(registered, MirroredVariable):
        registered._follow_own_tensor()  # registered again after a `set_` (parametrize does both)
        resolve_in_replicas(module)
    return replacement


def _on_buffer_registered(module: nn.Module, name: str, buffer: Any) -> Any:
    extended = _extended_in_scope() if buffer is not None else None
    return None if extended is None else extended.create_buffer(buffer, name)


def _install() -> None:
    nn.modules.module.register_module_parameter_registration_hook(_on_parameter_registered)
    nn.modules.module.register_module_buffer_registration_hook(_on_buffer_registered)


install_scope_hooks = Once(_install)
