# mypy: disable-error-code="attr-defined,misc,override"
# (The classes below are torch.Tensor subclasses built from a mixin: the mixin uses tensor
# methods mypy cannot see on it, and `values` / `__repr__` deliberately replace Tensor's.)
"""Distributed variables: MirroredVariable and SyncOnReadVariable.

Both are tensor subclasses over component 0's storage (on the first device); the other
components are plain leaf tensors on the other replica devices. Which component an
operation sees is decided per thread (see ``dispatch.py``), so a module built inside
``strategy.scope()`` runs unchanged in every replica thread. What they share, and the
per-operation dispatch, is ``DistributedVariable`` (``distributed_variable.py``); each
variable here adds what its writes, copies and cross-replica reads mean.

A MirroredVariable's component 0 is a plain leaf *alias* of it (same storage, same
version counter), not the variable itself: autograd records every replica's
gradient on a plain tensor, so replica 0 can run, differentiate and step on plain
tensors as the other replicas do, with no ``__torch_function__`` per operation (see
``_interpose/replica_parameters.py``). Operations on the variable itself still dispatch, and its
reads resolve to component 0 in cross-replica context too, so ``var.grad`` is always
component 0's gradient.
"""

from __future__ import annotations

import sys
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from unison._state import STATE
from unison._values.aggregation import VariableAggregation
from unison._values.dispatch import (
    call_plain,
    is_grad_access,
    is_mutation,
    is_own_attribute_write,
    map_variables,
    requires_grad_written,
)
from unison._values.distributed_variable import DistributedVariable
from unison._values.storage import MIRRORED, VariableStorage
from unison._values.values import PerReplica
from unison.errors import UsageError

__all__ = ["DistributedVariable", "MirroredVariable", "SyncOnReadVariable"]


_ASSIGN_OPS = {"copy_": "assign", "add_": "add", "sub_": "sub", "__iadd__": "add", "__isub__": "sub"}


class MirroredVariable(DistributedVariable, nn.Parameter):
    """A variable with one equal copy per replica device (``tf.distribute.MirroredVariable``).

    Reads inside a replica see that replica's component. Writes in cross-replica
    context reach every component. A write inside a replica is aggregated across
    replicas by the variable's ``aggregation`` (``copy_``/``assign``, ``add_``/
    ``assign_add``, ``sub_``/``assign_sub``); with ``VariableAggregation.NONE`` it is an
    error, as in TensorFlow. Optimizer steps write each replica's own component.

    ``storage`` says where the components live: ``MIRRORED`` (one copy per device) or
    ``CENTRAL`` (one copy on the first device, read by every replica; used by
    CentralStorageStrategy, where ``values`` has a single component).
    """

    def __new__(cls, data: torch.Tensor, strategy: Any = None, devices: Sequence[str] = ("cpu:0",),
                aggregation: VariableAggregation = VariableAggregation.NONE, name: str | None = None,
                requires_grad: bool = True, storage: VariableStorage = MIRRORED) -> MirroredVariable:
        with torch._C.DisableTorchFunctionSubclass():
            data = data.detach()
        self = torch.Tensor._make_subclass(cls, data, requires_grad)
        self._setup(strategy, devices, aggregation, name, storage)
        return self


    def __reduce_ex__(self, protocol: int) -> Any:
        # Pickles (torch.save, deepcopy) as the plain value of component 0.
        with torch._C.DisableTorchFunctionSubclass():
            return nn.Parameter(self._primary.detach().clone(), self._primary.requires_grad).__reduce_ex__(protocol)

    def __deepcopy__(self, memo: dict) -> nn.Parameter:
        # A new variable of the same strategy (as TensorFlow's DistributedVariable.__deepcopy__):
        # a module deep-copied in scope (nn.TransformerEncoder's cloned layers), or an EMA or
        # teacher copy taken later, trains like the original (see _strategies/joining.py).
        with torch._C.DisableTorchFunctionSubclass():
            value = nn.Parameter(self._primary.detach().clone(), self._primary.requires_grad)
        if self._strategy is not None:
            _check_copy_context(self, "parameter")
            variable = self._strategy.extended.create_parameter(value, self._var_name)
            value = value if variable is None else variable
        memo[id(self)] = value
        return value

    def _make_primary(self) -> torch.Tensor:
        return torch.Tensor.detach(self).requires_grad_(self.requires_grad)

    def _cross_replica_value(self) -> torch.Tensor:
        return self._primary

    def _write_own_attribute(self, func: Callable, args: tuple, kwargs: dict) -> None:
        """``param.data = t`` (``module.to(dtype)`` after ``scope()`` does it), ``param.requires_grad = b``,
        ``param.requires_grad_(b)`` in cross-replica context: written to the variable's own tensor
        (what C-level code reading the variable sees), which every component then follows."""
        call_plain(func, (self, *args[1:]), kwargs)
        self._follow_own_tensor()

    def _set_grad_everywhere(self, grad: torch.Tensor | None) -> None:
        """``p.grad = g`` in cross-replica context (``opt.zero_grad()`` between steps): every
        replica's component gets it (its own copy), else replicas would accumulate onto stale grads."""
        num_components = 1 + len(self._others)  # central storage: aliases of one tensor, one grad each
        for i in range(num_components):
            component_grad = grad
            if grad is not None and i > 0:
                with torch._C.DisableTorchFunctionSubclass():
                    component_grad = grad.detach().to(self.component(i).device, copy=True)
            self.set_component_grad(i, component_grad)

    def _cross_replica_op(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        if is_grad_access(func):
            if getattr(func, "__name__", "") == "__set__" and len(args) == 2:
                self._set_grad_everywhere(args[1])
                return None
            return NotImplemented
        if is_own_attribute_write(func, args, self):
            self._write_own_attribute(func, args, kwargs)
            return None if func.__name__ == "__set__" else self
        if func is _DETACH and args and args[0] is self and _called_by_parameter_constructor():
            # nn.Parameter(variable) (torch.nn.utils.parametrize does it with the weight it takes
            # over): for a tensor subclass, Parameter needs detach() to return that subclass. A
            # variable is a parameter already: it gets the variable itself, which stays one
            # variable when registered again in scope.
            return self
        if not is_mutation(func, args, kwargs, self):
            return NotImplemented
        out = call_plain(func, *map_variables((args, kwargs), lambda v: v._resolve_for_read(), DistributedVariable))
        self._broadcast_primary()
        return out

    def _replica_op(self, func: Callable, args: tuple, kwargs: dict, context: Any, replica_id: int) -> Any:
        handled = super()._replica_op(func, args, kwargs, context, replica_id)
        if (handled is not NotImplemented or STATE.own_component_writes.active
                or not is_mutation(func, args, kwargs, self)):
            return handled
        flag = requires_grad_written(func, args, kwargs, self)
        if flag is not None:
            self._require_grad_in_replica(replica_id, flag)
            return None if func.__name__ == "__set__" else self
        return self._aggregated_write(func, args, kwargs, context)

    def _require_grad_in_replica(self, replica_id: int, flag: bool) -> None:
        """``p.requires_grad_(b)`` inside a replica (freezing a layer, a GAN toggling its
        discriminator): the replica's own component, which its autograd records on, and the
        variable's own flag that cross-replica reads see. Not the other replicas' components:
        they may be in the middle of a forward pass, and each sets its own when it gets here
        (a step runs the same code in every replica)."""
        self.component(replica_id).requires_grad_(flag)
        with torch._C.DisableTorchFunctionSubclass():
            torch.Tensor.requires_grad_(self, flag)

    def _aggregated_write(self, func: Callable, args: tuple, kwargs: dict, context: Any) -> MirroredVariable:
        name = getattr(func, "__name__", repr(func))
        if self._aggregation is VariableAggregation.NONE:
            label = f" {self._var_name!r}" if self._var_name else ""
            raise ValueError(
                f"in-place `{name}` on MirroredVariable{label} inside a replica: with "
                f"aggregation=VariableAggregation.NONE replicas cannot write it, since their writes "
                f"would differ; create it with aggregation=SUM, MEAN or ONLY_FIRST_REPLICA, or write "
                f"it in cross-replica context (merge_call / strategy.extended.update)"
            )
        kind = _ASSIGN_OPS.get(name)
        if kind is None or len(args) < 2:
            raise ValueError(
                f"in-place `{name}` on a MirroredVariable inside a replica cannot be aggregated: use "
                f"copy_/assign, add_/assign_add or sub_/assign_sub, or write it in cross-replica context"
            )
        alpha = kwargs.get("alpha", args[2] if len(args) > 2 else 1)
        with torch.no_grad():
            value = torch.as_tensor(args[1], dtype=self.dtype, device=self.component(context.local_replica_id).device)
            value = value * alpha if kind != "assign" else value.clone()
            if kind == "sub":
                value = -value
        context.merge_call(_merge_aggregated_write, args=(self, value, kind))
        return self


_DETACH = torch._C.TensorBase.detach
_PARAMETER_CONSTRUCTOR = nn.Parameter.__new__.__code__


def _called_by_parameter_constructor() -> bool:
    """Whether ``nn.Parameter(...)`` made the operation being dispatched (a frame or two up:
    the dispatch's own frames come between)."""
    frame: types.FrameType | None = sys._getframe(2)
    for _ in range(3):
        if frame is None:
            return False
        if frame.f_code is _PARAMETER_CONSTRUCTOR:
            return True
        frame = frame.f_back
    return False


def _merge_aggregated_write(strategy: Any, var: MirroredVariable, value: Any, kind: str) -> None:
    n = len(var.devices)
    if not isinstance(value, PerReplica):
        value = PerReplica([value] * n)
    if var.aggregation is VariableAggregation.ONLY_FIRST_REPLICA:
        reduced = strategy.extended.broadcast_to(value.values[0], var)
    else:
        reduced = strategy.extended.reduce_to(var.aggregation.reduce_op(), value, destinations=var)
    if kind == "assign":
        strategy.extended.update(var, lambda component, v: component.copy_(v), args=(reduced,))
    else:
        strategy.extended.update(var, lambda component, v: component.add_(v), args=(reduced,))


def _check_copy_context(variable: DistributedVariable, kind: str) -> None:
    """A distributed variable is deep-copied in cross-replica context, outside other strategies' scopes."""
    entry = STATE.top()
    if entry is None:
        return
    if entry.replica_context is not None:
        raise UsageError(
            f"copy.deepcopy of a distributed {kind} ({variable._var_name!r}) inside strategy.run: every replica "
            f"would make its own copy; copy the module outside strategy.run (in or out of the scope: the "
            f"copy is a variable of the same strategy)"
        )
    if entry.strategy is not variable._strategy and not entry.strategy.extended.components.is_default:
        raise ValueError(
            f"copy.deepcopy of a {kind} of {type(variable._strategy).__name__} ({variable._var_name!r}) inside "
            f"the scope of another strategy ({type(entry.strategy).__name__}): the copy belongs to the "
            f"original's strategy; take it outside `with other_strategy.scope():`"
        )


@typing.final
class SyncOnReadVariable(DistributedVariable, torch.Tensor):
    """A variable each replica writes on its own; a cross-replica read aggregates
    (``tf.distribute.SyncOnReadVariable``).

    Typical use: metrics and statistics. Inside a replica every read and write uses the
    local component. In cross-replica context a read returns the aggregate of all
    components (SUM, MEAN or ONLY_FIRST_REPLICA; across workers too); ``copy_``/
    ``assign`` stores the value so that it reads back unchanged (divided by the number
    of replicas for SUM); other in-place ops (``zero_()``) apply to every component.
    """

    def __new__(cls, data: torch.Tensor, strategy: Any = None, devices: Sequence[str] = ("cpu:0",),
                aggregation: VariableAggregation = VariableAggregation.SUM,
                name: str | None = None) -> SyncOnReadVariable:
        if aggregation is VariableAggregation.NONE:
            raise ValueError(
                "SyncOnReadVariable needs an aggregation to read it in cross-replica context, got "
                "VariableAggregation.NONE; pass aggregation=SUM, MEAN or ONLY_FIRST_REPLICA"
            )
        with torch._C.DisableTorchFunctionSubclass():
            data = data.detach()
        self = torch.Tensor._make_subclass(cls, data, False)
        self._setup(strategy, devices, aggregation, name)
        return self

    def _make_primary(self) -> torch.Tensor:
        # A plain alias of the variable (same storage and version counter), as a mirrored
        # variable's: replica 0 reads and updates it (BatchNorm's running statistics) as
        # a plain tensor, which torch.compile can trace.
        return torch.Tensor.detach(self)

    def __reduce_ex__(self, protocol: int) -> Any:
        return self._cross_replica_value().clone().__reduce_ex__(protocol)

    def __deepcopy__(self, memo: dict) -> torch.Tensor:
        # A new variable of the same strategy, each component copied (a module's buffer: the
        # copy's replicas keep their own running statistics, as the original's do).
        if self._strategy is None:
            memo[id(self)] = plain = self._cross_replica_value().clone()
            return plain
        _check_copy_context(self, "buffer")
        values = self.values
        copied = self._strategy.extended.create_buffer(values[0].clone(), self._var_name)
        if isinstance(copied, SyncOnReadVariable):
            with torch.no_grad():
                for mine, theirs in zip(copied.values, values):
                    mine.copy_(theirs)
        memo[id(self)] = copied
        return copied

    def _cross_replica_value(self) -> torch.Tensor:
        if self._aggregation is VariableAggregation.ONLY_FIRST_REPLICA:
            return self.values[0]
        return self._strategy.extended.reduce_to(
            self._aggregation.reduce_op(), PerReplica(self.values), self._devices[0]
        )

    def _cross_replica_op(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        if is_grad_access(func) or not is_mutation(func, args, kwargs, self):
            return NotImplemented
        if getattr(func, "__name__", "") == "copy_" and len(args) >= 2:
            value = torch.as_tensor(args[1], dtype=self.dtype)
            if self._aggregation is VariableAggregation.SUM:
                value = value / self._strategy.num_replicas_in_sync
            with torch.no_grad():
                for component in self.values:
                    component.copy_(value)
            return self
        with torch.no_grad():
            for component in self.values:
                call_plain(func, *map_variables(
                    (args, kwargs),
                    lambda v: component if v is self else v._resolve_for_read(),  # noqa: B023 - called within the iteration
                    DistributedVariable,
                ))
        return self
