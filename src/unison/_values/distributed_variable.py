# mypy: disable-error-code="attr-defined,misc,override"
# (DistributedVariable is a mixin of torch.Tensor subclasses: it uses tensor methods mypy
# cannot see on it, and `values` / `__repr__` deliberately replace Tensor's.)
"""DistributedVariable: what every distributed variable shares, and its per-operation dispatch.

A distributed variable is a tensor subclass over component 0's storage (on the first
device); the other components are plain leaf tensors on the other replica devices.
Which component an operation sees is decided per thread (see ``dispatch.py``), so a
module built inside ``strategy.scope()`` runs unchanged in every replica thread. The
abstract mixin and the fast path of ``__torch_function__`` live here, apart from the two
concrete variables (``variables.py``), because every operation on any distributed
variable runs through them: one module to read for what a step costs per operation.
"""

from __future__ import annotations

import abc
import typing
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

from unison._state import STATE
from unison._values.aggregation import VariableAggregation
from unison._values.dispatch import call_plain, find_variables, is_grad_access, is_plain_read, map_variables, replica_of
from unison._values.storage import MIRRORED, VariableStorage
from unison._values.values import DistributedValues

__all__ = ["DistributedVariable"]


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

    @property
    def distribute_strategy(self) -> Any:
        """The strategy this variable belongs to (TensorFlow's ``Variable.distribute_strategy``)."""
        return self._strategy

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
    def assign(self, value: Any) -> DistributedVariable:
        """Writes ``value`` (``tf.Variable.assign``); in replica context it is aggregated."""
        with torch.no_grad():
            self.copy_(torch.as_tensor(value, dtype=self.dtype))
        return self

    def assign_add(self, delta: Any) -> DistributedVariable:
        """Adds ``delta`` (``tf.Variable.assign_add``)."""
        with torch.no_grad():
            self.add_(torch.as_tensor(delta, dtype=self.dtype))
        return self

    def assign_sub(self, delta: Any) -> DistributedVariable:
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
    def __torch_function__(
        cls, func: Callable[..., Any], types: tuple, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
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
