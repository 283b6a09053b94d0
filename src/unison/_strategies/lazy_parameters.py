"""Lazy modules (``nn.LazyLinear`` & co) built in a strategy's scope.

A lazy module registers ``UninitializedParameter``s (and buffers): no shape, no values,
nothing to mirror or broadcast yet. PyTorch turns them into parameters in place at the
module's first forward (``LazyModuleMixin``), and asks for that first forward (a dry
run) before the optimizer is made, as DDP does. So the strategy takes them then: their
registration in scope is deferred, and a forward pre-hook that runs right after
PyTorch's initialisation registers them again, in the strategy's cross-replica context
(whether the dry run is inside ``scope()`` or after it), where they become the
strategy's variables like any other parameter.

The dry run must not happen inside ``strategy.run`` when replicas or workers are
several: replica threads would initialise the module at once, and workers would draw
different weights. A pre-hook that runs before PyTorch's says so, before anything is
drawn.
"""

from __future__ import annotations

import typing
import weakref
from typing import Any

from torch import nn
from torch.nn.parameter import is_lazy

from unison._state import STATE
from unison.errors import UsageError

__all__ = ["defer_until_materialized"]

_PENDING: weakref.WeakKeyDictionary[nn.Module, _Pending] = weakref.WeakKeyDictionary()
"""Each lazy module built in scope -> its tensors waiting for its first forward (a side table:
nothing is stashed on the user's module)."""


@typing.final
class _Pending:
    """The lazy tensors of one module waiting for its first forward, and the hooks that wait."""

    def __init__(self, module: nn.Module, strategy: Any):
        self.strategy = weakref.ref(strategy)  # the module must not keep the strategy alive
        self.names: dict[str, str] = {}  # name -> "parameter" | "buffer"
        self.guard = module.register_forward_pre_hook(self._guard, prepend=True)
        self.finisher = module.register_forward_pre_hook(self._finish)

    def _guard(self, module: nn.Module, args: Any) -> None:
        strategy = self.strategy()
        entry = STATE.top()
        if strategy is None or entry is None or entry.replica_context is None:
            return
        if strategy.num_replicas_in_sync > 1:
            raise UsageError(
                f"{type(module).__name__} was first called inside strategy.run of {type(strategy).__name__} "
                f"with {strategy.num_replicas_in_sync} replicas: its lazy parameters would be drawn by every "
                f"replica at once. Run one forward pass first, outside strategy.run (inside or after "
                f"strategy.scope(), e.g. model(example_batch)), then make the optimizer"
            )

    def _finish(self, module: nn.Module, args: Any) -> None:
        materialized = {name: kind for name, kind in self.names.items() if not is_lazy(_tensor(module, name, kind))}
        if not materialized:
            return
        strategy = self.strategy()
        if strategy is not None:
            with STATE.push(strategy, None):  # cross-replica: the registration hooks make variables
                for name, kind in materialized.items():
                    _register_again(module, name, kind)
        for name in materialized:
            del self.names[name]
        if not self.names:
            self.guard.remove()
            self.finisher.remove()
            _PENDING.pop(module, None)  # a deep copy carries its own (through its hooks), not listed


def _tensor(module: nn.Module, name: str, kind: str) -> Any:
    return (module._parameters if kind == "parameter" else module._buffers)[name]


def _register_again(module: nn.Module, name: str, kind: str) -> None:
    tensor = _tensor(module, name, kind)
    if kind == "parameter":
        module.register_parameter(name, tensor)
    else:
        module.register_buffer(name, tensor, persistent=name not in module._non_persistent_buffers_set)


def defer_until_materialized(module: nn.Module, name: str, kind: str, strategy: Any) -> None:
    """Leaves lazy parameter or buffer ``name`` of ``module`` to be made ``strategy``'s at its first forward."""
    pending = _PENDING.get(module)
    if pending is None:
        pending = _PENDING[module] = _Pending(module, strategy)
    pending.names[name] = kind
