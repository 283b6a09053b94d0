# mypy: disable-error-code="attr-defined,misc,override"
# (The classes below are torch.Tensor subclasses built from a mixin: the mixin uses tensor
# methods mypy cannot see on it, and `values` / `__repr__` deliberately replace Tensor's.)
"""Distributed variables: MirroredVariable and SyncOnReadVariable.

Both are tensor subclasses over component 0's storage (on the first device); the other
components are plain leaf tensors on the other replica devices. Which component an
operation sees is decided per thread (see ``dispatch.py``), so a module built inside
``strategy.scope()`` runs unchanged in every replica thread.

A MirroredVariable's component 0 is a plain leaf *alias* of it (same storage, same
version counter), not the variable itself: autograd records every replica's
gradient on a plain tensor, so replica 0 can run, differentiate and step on plain
tensors as the other replicas do, with no ``__torch_function__`` per operation (see
``replica_parameters.py``). Operations on the variable itself still dispatch, and its
reads resolve to component 0 in cross-replica context too, so ``var.grad`` is always
component 0's gradient.
"""

from __future__ import annotations

import abc
import sys
import types
import typing
from typing import Any, Callable, Sequence, cast

import torch
from torch import nn

from unison.values.aggregation import VariableAggregation
from unison._state import STATE
from unison.errors import UsageError
from unison.values.dispatch import (call_plain, find_variables, is_grad_access, is_mutation, is_own_attribute_write,
                                    is_plain_read, map_variables, replica_of, requires_grad_written)
from unison.values.storage import MIRRORED, VariableStorage
from unison.values.values import DistributedValues, PerReplica

__all__ = ["DistributedVariable", "MirroredVariable", "SyncOnReadVariable"]


_ASSIGN_OPS = {"copy_": "assign", "add_": "add", "sub_": "sub", "__iadd__": "add", "__isub__": "sub"}


class DistributedVariable(DistributedValues):
    """Behaviour shared by MirroredVariable and SyncOnReadVariable: abstract.

    A mixin of tensor subclasses (whose metaclass cannot also be ``ABCMeta``); the
    members marked abstract are implemented by each concrete variable, which a test
    checks. The variable's strategy is used only through its public API
    (``extended.reduce_to``, ``update``, ``broadcast_to``, ``num_replicas_in_sync``).
    """

    __slots__ = ()
    _strategy: Any
    _devices: tuple[str, ...]
    _others: list[torch.Tensor]
    _primary: torch.Tensor
    _aggregation: VariableAggregation
    _var_name: str | None
    _storage: VariableStorage = MIRRORED

    def _setup(self, strategy: Any, devices: Sequence[str], aggregation: VariableAggregation, name: str | None,
               storage: VariableStorage = MIRRORED) -> None:
        self._strategy = strategy
        self._storage = storage
        self._devices = storage.component_devices(devices)
        self._aggregation = aggregation
        self._var_name = name
        with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
            self._primary = self._make_primary()
            self._others = storage.make_others(self._primary, devices)

    def _make_primary(self) -> torch.Tensor:
        """Component 0 (called with subclass dispatch disabled): the variable itself by default."""
        return cast(torch.Tensor, self)

    # -- components ---------------------------------------------------------------------
    @property
    def values(self) -> tuple[torch.Tensor, ...]:
        """The components as plain tensors, one per local replica device (component 0 shares storage)."""
        with torch._C.DisableTorchFunctionSubclass():
            return (self._primary.detach(), *self._others[: len(self._devices) - 1])

    @property
    def devices(self) -> tuple[str, ...]:
        """Canonical names of the devices that hold the components."""
        return self._devices

    @property
    def aggregation(self) -> VariableAggregation:
        """How replica-context writes (mirrored) or cross-replica reads (sync-on-read) combine replicas."""
        return self._aggregation

    @property
    def name(self) -> str | None:
        """The name given at creation, or None."""
        return self._var_name

    def component(self, replica_id: int) -> torch.Tensor:
        """Local replica ``replica_id``'s component: a plain leaf tensor on its device
        (under central storage, every replica's is an alias of the one copy)."""
        return self._primary if replica_id == 0 else self._others[replica_id - 1]

    def component_grad(self, replica_id: int) -> torch.Tensor | None:
        """The gradient of local replica ``replica_id``'s component, or None."""
        with torch._C.DisableTorchFunctionSubclass():
            return self.component(replica_id).grad

    def set_component_grad(self, replica_id: int, grad: torch.Tensor | None) -> None:
        """Sets the gradient of local replica ``replica_id``'s component (the gradient synchronisers' hand-out)."""
        with torch._C.DisableTorchFunctionSubclass():
            self.component(replica_id).grad = grad

    @property
    def storage(self) -> VariableStorage:
        """Where the components live: one copy per device, or one central copy."""
        return self._storage

    def _broadcast_primary(self) -> None:
        """Makes every component equal to component 0."""
        with torch._C.DisableTorchFunctionSubclass():
            self._storage.broadcast(self._primary, self._others)

    def _follow_own_tensor(self) -> None:
        """Makes component 0 the variable's own tensor again, and the other components follow:
        its storage, when it was replaced (``param.data = t``, or ``param.set_(t)``, which
        PyTorch does not route through ``__torch_function__``: ``torch.nn.utils.parametrize``
        does it to the weight it takes over, then registers the weight again), and whether it
        requires grad."""
        primary = self._primary
        if primary is self:
            return
        with torch._C.DisableTorchFunctionSubclass():
            own = torch.Tensor.detach(cast(torch.Tensor, self))
            if not (own.data_ptr() == primary.data_ptr() and own.shape == primary.shape
                    and own.stride() == primary.stride() and own.dtype == primary.dtype):
                primary.data = own
                self._storage.follow_new_data(primary, self._others)
            for component in (primary, *self._others):
                component.requires_grad_(self.requires_grad)

    # -- TF-style writes ----------------------------------------------------------------
    def assign(self, value: Any) -> "DistributedVariable":
        """Writes ``value`` (``tf.Variable.assign``); in replica context it is aggregated."""
        with torch.no_grad():
            self.copy_(torch.as_tensor(value, dtype=self.dtype))
        return self

    def assign_add(self, delta: Any) -> "DistributedVariable":
        """Adds ``delta`` (``tf.Variable.assign_add``)."""
        with torch.no_grad():
            self.add_(torch.as_tensor(delta, dtype=self.dtype))
        return self

    def assign_sub(self, delta: Any) -> "DistributedVariable":
        """Subtracts ``delta`` (``tf.Variable.assign_sub``)."""
        with torch.no_grad():
            self.sub_(torch.as_tensor(delta, dtype=self.dtype))
        return self

    def read_value(self) -> torch.Tensor:
        """The value this context sees, as a plain tensor."""
        return self.detach()

    def __repr__(self) -> str:
        with torch._C.DisableTorchFunctionSubclass():
            inner = ",\n".join(f"  {i}: {torch.Tensor.__repr__(c.detach())}" for i, c in enumerate(self.values))
        return f"{type(self).__name__}:{{\n{inner}\n}}"

    # -- dispatch -----------------------------------------------------------------------
    @classmethod
    def __torch_function__(cls, func: Callable[..., Any], types: tuple, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if is_plain_read(func) or STATE.own_component_writes.active:  # an optimizer step writes its own component
            handled = _read_in_replica(func, args, kwargs)
            if handled is not NotImplemented:
                return handled
        variables = find_variables((args, kwargs), DistributedVariable, [])
        for var in variables:
            context, replica_id = replica_of(var)
            if replica_id is None:
                handled = var._cross_replica_op(func, args, kwargs)
            else:
                handled = var._replica_op(func, args, kwargs, context, replica_id)
            if handled is not NotImplemented:
                return handled
        resolved = {id(v): v._resolve_for_read() for v in variables}
        args, kwargs = map_variables((args, kwargs), lambda v: resolved[id(v)], DistributedVariable)
        return call_plain(func, args, kwargs)

    def _resolve_for_read(self) -> torch.Tensor:
        _, replica_id = replica_of(self)
        if replica_id is not None:
            return self.component(replica_id)
        return self._cross_replica_value()

    def _replica_op(self, func: Callable, args: tuple, kwargs: dict, context: Any, replica_id: int) -> Any:
        """Handles ``func`` in replica context when it needs more than reading; else NotImplemented."""
        if is_grad_access(func):
            return call_plain(func, (self.component(replica_id), *args[1:]), kwargs)
        return NotImplemented

    @abc.abstractmethod
    def _cross_replica_op(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """Handles ``func`` in cross-replica context when it needs more than reading; else NotImplemented."""

    @abc.abstractmethod
    def _cross_replica_value(self) -> torch.Tensor:
        """The value a cross-replica read sees."""


@typing.final
def _read_in_replica(func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """The fast path of most operations in a replica: ``func`` on the replica's components.

    Taken when ``func`` only reads (or is a ``.grad`` access, or an optimizer step writes
    this replica's own components), this thread runs a replica of the variables'
    strategy, and the variables sit directly in ``args`` (``F.linear(x, weight, bias)``,
    ``weight.t()``); anything else (containers of variables, ``out=``, variables of
    another strategy) returns NotImplemented and goes through the general dispatch.
    Same result as the general path, at a fraction of its Python work per operation.
    """
    entry = STATE.top()
    context = entry.replica_context if entry is not None else None
    if context is None or "out" in kwargs:
        return NotImplemented
    strategy, replica_id = context.strategy, context.local_replica_id
    plain = list(args)
    for i, arg in enumerate(plain):
        if isinstance(arg, DistributedVariable):
            if arg._strategy is not strategy:
                return NotImplemented
            plain[i] = arg.component(replica_id)
        elif isinstance(arg, (list, tuple, dict)) and find_variables(arg, DistributedVariable, []):
            return NotImplemented
    if kwargs and find_variables(kwargs, DistributedVariable, []):
        return NotImplemented
    with torch._C.DisableTorchFunctionSubclass():
        return func(*plain, **kwargs)


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
                requires_grad: bool = True, storage: VariableStorage = MIRRORED) -> "MirroredVariable":
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
        # teacher copy taken later, trains like the original (see strategies/joining.py).
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
        if handled is not NotImplemented or STATE.own_component_writes.active or not is_mutation(func, args, kwargs, self):
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

    def _aggregated_write(self, func: Callable, args: tuple, kwargs: dict, context: Any) -> "MirroredVariable":
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
    frame: "types.FrameType | None" = sys._getframe(2)
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
    """A variable each replica writes on its own; a cross-replica read aggregates (``tf.distribute.SyncOnReadVariable``).

    Typical use: metrics and statistics. Inside a replica every read and write uses the
    local component. In cross-replica context a read returns the aggregate of all
    components (SUM, MEAN or ONLY_FIRST_REPLICA; across workers too); ``copy_``/
    ``assign`` stores the value so that it reads back unchanged (divided by the number
    of replicas for SUM); other in-place ops (``zero_()``) apply to every component.
    """

    def __new__(cls, data: torch.Tensor, strategy: Any = None, devices: Sequence[str] = ("cpu:0",),
                aggregation: VariableAggregation = VariableAggregation.SUM, name: str | None = None) -> "SyncOnReadVariable":
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
        return self._strategy.extended.reduce_to(self._aggregation.reduce_op(), PerReplica(self.values), self._devices[0])

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
                call_plain(func, *map_variables((args, kwargs), lambda v: component if v is self else v._resolve_for_read(), DistributedVariable))
        return self
