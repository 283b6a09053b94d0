"""Routing of torch operations on distributed variables to the right component.

A distributed variable is a tensor subclass whose own storage is component 0. Its
``__torch_function__`` looks at the thread's context: inside replica ``i`` of its
strategy every operation sees component ``i`` (so autograd records the gradient on
that component, and ``p.grad`` reads and writes that component's gradient); in
cross-replica context the variable class decides (mirrored: read component 0, write
all; sync-on-read: read the aggregate).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from unison._state import STATE

__all__ = ["is_plain_read", "is_grad_access", "is_own_attribute_write", "requires_grad_written", "is_mutation",
           "map_variables",
           "find_variables", "call_plain", "replica_of"]

_GRAD_DESCRIPTOR = torch.Tensor.grad
_INPLACE_DUNDERS = frozenset(
    {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
     "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__"}
)


def is_grad_access(func: Callable[..., Any]) -> bool:
    """Whether ``func`` is the getter or setter of ``Tensor.grad``."""
    return getattr(func, "__self__", None) is _GRAD_DESCRIPTOR


_OWN_ATTRIBUTES = (torch._C.TensorBase.data, torch._C.TensorBase.requires_grad)
_REQUIRES_GRAD_ = torch._C.TensorBase.requires_grad_


def is_own_attribute_write(func: Callable[..., Any], args: tuple, tensor: Any) -> bool:
    """Whether ``func`` replaces ``tensor``'s data or sets whether it requires grad
    (``t.data = x``, ``t.requires_grad = b``, ``t.requires_grad_(b)``)."""
    if not args or args[0] is not tensor:
        return False
    if func is _REQUIRES_GRAD_:
        return True
    owner = getattr(func, "__self__", None)
    return _func_name(func) == "__set__" and any(owner is attribute for attribute in _OWN_ATTRIBUTES)


def requires_grad_written(func: Callable[..., Any], args: tuple, kwargs: dict, tensor: Any) -> bool | None:
    """The flag ``func`` sets on ``tensor`` when it is ``t.requires_grad_(b)`` or ``t.requires_grad = b``; else None."""
    if not args or args[0] is not tensor:
        return None
    if func is _REQUIRES_GRAD_:
        return bool(args[1]) if len(args) > 1 else bool(kwargs.get("requires_grad", True))
    if _func_name(func) == "__set__" and getattr(func, "__self__", None) is _OWN_ATTRIBUTES[1] and len(args) == 2:
        return bool(args[1])
    return None


_PLAIN_READS: dict[Any, bool] = {}


def is_plain_read(func: Callable[..., Any]) -> bool:
    """Whether ``func`` in a replica is simply ``func`` on the replica's components (cached per function).

    True for functions that write none of their inputs, and for the ``.grad`` getter and
    setter (a replica reads and sets its own component's gradient): a variable there is
    replaced by its replica's component without asking the variable's class. False for
    in-place functions, which mirrored variables aggregate across replicas.
    """
    known = _PLAIN_READS.get(func)
    if known is None:
        name = _func_name(func)
        known = is_grad_access(func) or not (
            name in _INPLACE_DUNDERS or (name.endswith("_") and not name.startswith("__"))
            or name in ("__set__", "__setattr__", "__delete__", "set_"))
        try:
            _PLAIN_READS[func] = known
        except TypeError:  # an unhashable callable: decide again next time
            pass
    return known


def _func_name(func: Callable[..., Any]) -> str:
    return getattr(func, "__name__", "")


def is_mutation(func: Callable[..., Any], args: tuple, kwargs: dict, variable: Any) -> bool:
    """Whether ``func`` writes into ``variable`` (it is the in-place target or the ``out=``)."""
    out = kwargs.get("out")
    if out is variable or (isinstance(out, (tuple, list)) and any(o is variable for o in out)):
        return True
    name = _func_name(func)
    if not (name in _INPLACE_DUNDERS or (name.endswith("_") and not name.startswith("__"))):
        return False
    if args:
        target = args[0]
    else:  # nn.init's uniform_/normal_/constant_/kaiming_uniform_ dispatch with `tensor=` as keyword
        target = next((kwargs[k] for k in ("tensor", "input", "self") if k in kwargs), None)
        if target is None:
            return False
    if target is variable:
        return True
    # foreach in-place ops take a list of targets first
    return isinstance(target, (list, tuple)) and any(t is variable for t in target)


def map_variables(structure: Any, fn: Callable[[Any], Any], cls: type) -> Any:
    """Replaces instances of ``cls`` in args/kwargs (through lists, tuples and dicts).

    Containers without a variable come back as the very same object.
    """
    if isinstance(structure, cls):
        return fn(structure)
    if isinstance(structure, (list, tuple)):
        mapped = [map_variables(x, fn, cls) for x in structure]
        if all(m is x for m, x in zip(mapped, structure)):
            return structure
        if isinstance(structure, list):
            return mapped
        return type(structure)(*mapped) if hasattr(structure, "_fields") else tuple(mapped)
    if isinstance(structure, dict):
        return {k: map_variables(v, fn, cls) for k, v in structure.items()}
    return structure


def find_variables(structure: Any, cls: type, found: list) -> list:
    """Collects the instances of ``cls`` in args/kwargs, in order, without duplicates."""
    if isinstance(structure, cls):
        if not any(structure is f for f in found):
            found.append(structure)
    elif isinstance(structure, (list, tuple)):
        for x in structure:
            find_variables(x, cls, found)
    elif isinstance(structure, dict):
        for x in structure.values():
            find_variables(x, cls, found)
    return found


def call_plain(func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """Calls ``func`` with subclass dispatch disabled, so the variables act as plain tensors."""
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def replica_of(variable: Any) -> tuple[Any, int] | tuple[None, None]:
    """(replica context, local replica id) when this thread runs a replica of ``variable``'s strategy."""
    entry = STATE.top()
    if entry is None or entry.replica_context is None:
        return None, None
    context = entry.replica_context
    if context.strategy is not variable._strategy:
        return None, None
    return context, context.local_replica_id
