"""Module registration hooks: parameters and buffers of modules built in ``scope()`` follow the strategy.

PyTorch's global parameter- and buffer-registration hooks are installed once per
process. Inside a (non-default) strategy's scope, in cross-replica context, a new
parameter or buffer is handed to ``strategy.extended.create_parameter`` /
``create_buffer``, whose variable policy decides what it becomes: a distributed
variable, a tensor moved to the strategy's device, or itself. Outside every scope, a
parameter or buffer that replaces one of a strategy's (``load_state_dict(...,
assign=True)``) joins that strategy (``joining.py``, which also makes deep copies join).
In a replica, the hooks return at once. A module that gets a mirrored variable as a parameter reads it, in a
replica, as the replica's plain component (``_interpose/replica_parameters.py``). A lazy
module's uninitialised parameters are taken at its first forward (``lazy_parameters.py``).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.nn.parameter import is_lazy

from unison._interpose.module_hooks import registration_hooks
from unison._interpose.replica_parameters import resolve_in_replicas
from unison._state import STATE
from unison._strategies.joining import install_copy_hook, join_like
from unison._strategies.lazy_parameters import defer_until_materialized
from unison._values.variables import MirroredVariable

__all__ = ["install_scope_hooks"]


def _strategy_in_scope() -> Any:
    """The (non-default) strategy whose scope this thread is in, in cross-replica context; else None."""
    entry = STATE.top()
    if entry is None or entry.replica_context is not None:
        return None
    return None if entry.strategy.extended.components.is_default else entry.strategy


def _on_parameter_registered(module: nn.Module, name: str, param: Any) -> Any:
    strategy = _strategy_in_scope() if param is not None else None
    if strategy is not None and is_lazy(param):  # a lazy module's: taken at its first forward
        defer_until_materialized(module, name, "parameter", strategy)
        return None
    if strategy is not None:
        replacement = strategy.extended.create_parameter(param, name)
    elif param is not None and STATE.top() is None:  # outside any scope: it may replace a strategy's parameter
        replacement = join_like(param, module.__dict__.get("_parameters", {}).get(name), name, "parameter")
    else:
        replacement = None
    registered = param if replacement is None else replacement
    if isinstance(registered, MirroredVariable):
        registered._follow_own_tensor()  # registered again after a `set_` (parametrize does both)
        resolve_in_replicas(module)
    return replacement


def _on_buffer_registered(module: nn.Module, name: str, buffer: Any) -> Any:
    strategy = _strategy_in_scope() if buffer is not None else None
    if strategy is not None and is_lazy(buffer):
        defer_until_materialized(module, name, "buffer", strategy)
        return None
    if strategy is not None:
        return strategy.extended.create_buffer(buffer, name)
    if buffer is not None and STATE.top() is None:  # outside any scope: it may replace a strategy's buffer
        return join_like(buffer, module.__dict__.get("_buffers", {}).get(name), name, "buffer")
    return None


def install_scope_hooks() -> None:
    """Installs the registration hooks and the deep-copy hook (once; ``_interpose/module_hooks.py``)."""
    registration_hooks(on_parameter=_on_parameter_registered, on_buffer=_on_buffer_registered)
    install_copy_hook()
