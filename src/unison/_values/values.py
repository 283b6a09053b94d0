"""Distributed values: one component per replica.

``PerReplica`` holds values that differ between replicas (each replica's batch or
loss); ``Mirrored`` holds values known to be equal on every replica (the result of an
all-reduce). Both are plain containers: the strategy decides where components live.
"""

from __future__ import annotations

import abc
import typing
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = [
    "DistributedValues", "PerReplica", "Mirrored", "regroup", "select_replica", "is_distributed",
    "may_hold_components",
]


class DistributedValues:
    """Base of every value with one component per replica (``tf.distribute.DistributedValues``): abstract.

    ``values`` is the tuple of components, in replica order of this worker. (No
    ``ABCMeta``: distributed variables are tensor subclasses of it, whose metaclass is
    torch's; a test checks that every concrete class implements the abstract members.)
    """

    __slots__ = ()

    @property
    @abc.abstractmethod
    def values(self) -> tuple[Any, ...]:
        """The components, one per local replica, in replica order."""


class _ValueContainer(DistributedValues):
    """A tuple of components: the body PerReplica and Mirrored share; they differ in type only."""

    __slots__ = ("_values",)

    def __init__(self, values: Sequence[Any]):
        values = tuple(values)
        if not values:
            raise ValueError(f"{type(self).__name__} needs at least one component, got none")
        self._values = values

    @property
    def values(self) -> tuple[Any, ...]:
        return self._values

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        inner = ",\n".join(f"  {i}: {v!r}" for i, v in enumerate(self._values))
        return f"{type(self).__name__}:{{\n{inner}\n}}"


@typing.final
class PerReplica(_ValueContainer):
    """Values that may differ from replica to replica (``tf.distribute.PerReplica``)."""

    __slots__ = ()


@typing.final
class Mirrored(_ValueContainer):
    """Values that are equal on every replica, one copy per replica device."""

    __slots__ = ()


def is_distributed(value: Any) -> bool:
    """Whether ``value`` is a DistributedValues (container or distributed variable)."""
    return isinstance(value, DistributedValues)


_PLAIN_LEAVES = (torch.Tensor, int, float, complex, str, bytes, type(None))


def may_hold_components(structure: Any) -> bool:
    """False only when ``structure`` surely holds no PerReplica/Mirrored leaf.

    A cheap pre-check for the one-replica fast path (``select_replica`` goes through
    pytree, tens of microseconds per call): plain tuples, lists and dicts of tensors
    and scalars are walked directly; other objects are pytree nodes (then it answers
    True and lets pytree look) or leaves that are no distributed value.
    """
    if isinstance(structure, _ValueContainer):
        return True
    if isinstance(structure, _PLAIN_LEAVES):
        return False
    kind = type(structure)
    if kind is tuple or kind is list:
        return any(may_hold_components(x) for x in structure)
    if kind is dict:
        return any(may_hold_components(x) for x in structure.values())
    # A module, an optimizer or any other object pytree does not open is a leaf: it holds
    # no component that select_replica would replace (and is no container itself).
    return not pytree.tree_is_leaf(structure)


_NOT_PLAIN = object()


def _pick_component(replica_id: int, value: _ValueContainer) -> Any:
    if replica_id >= len(value.values):
        raise ValueError(
            f"{type(value).__name__} has {len(value.values)} components but replica "
            f"{replica_id} asked for one: pass one component per replica"
        )
    return value.values[replica_id]


def _select_plain(replica_id: int, structure: Any) -> Any:
    """``select_replica`` over plain tuples, lists and dicts, without pytree (tens of
    microseconds per step on the run arguments); ``_NOT_PLAIN`` for anything else."""
    if isinstance(structure, _ValueContainer):
        return _pick_component(replica_id, structure)
    if isinstance(structure, _PLAIN_LEAVES):
        return structure
    kind = type(structure)
    if kind is tuple or kind is list:
        items = []
        for x in structure:
            picked = _select_plain(replica_id, x)
            if picked is _NOT_PLAIN:
                return _NOT_PLAIN
            items.append(picked)
        return tuple(items) if kind is tuple else items
    if kind is dict:
        out = {}
        for key, x in structure.items():
            picked = _select_plain(replica_id, x)
            if picked is _NOT_PLAIN:
                return _NOT_PLAIN
            out[key] = picked
        return out
    return _NOT_PLAIN


def _identical(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are the same object, or plain tuples/lists/dicts of the same objects."""
    if a is b:
        return True
    kind = type(a)
    if kind is not type(b):
        return False
    if kind is tuple or kind is list:
        return len(a) == len(b) and all(_identical(x, y) for x, y in zip(a, b))
    if kind is dict:
        return a.keys() == b.keys() and all(_identical(a[k], b[k]) for k in a)
    return False


def select_replica(replica_id: int, structure: Any) -> Any:
    """Replaces every PerReplica/Mirrored leaf of ``structure`` by its component ``replica_id``.

    Distributed variables are kept whole: they resolve to the local component by
    themselves inside replica context, and merge functions need the variable itself.
    """

    if not may_hold_components(structure):  # the common merge result (None) and plain arguments
        return structure
    picked = _select_plain(replica_id, structure)
    if picked is not _NOT_PLAIN:
        return picked

    def pick(leaf: Any) -> Any:
        return _pick_component(replica_id, leaf) if isinstance(leaf, _ValueContainer) else leaf

    return pytree.tree_map(pick, structure, is_leaf=is_distributed)


def regroup(per_replica: Sequence[Any], wrap: Callable[[Sequence[Any]], Any] = PerReplica) -> Any:
    """Turns a list of per-replica structures into one structure of PerReplica leaves.

    Leaves that are the very same object on every replica (a variable, a constant)
    come back as that object; other leaves become ``wrap(components)``.

    Raises:
        ValueError: if the replicas returned structures of different shapes.
    """
    first_structure = per_replica[0]
    if all(_identical(first_structure, s) for s in per_replica[1:]):
        # Every leaf is the same object on every replica (None results, a merge over the
        # same variables): regrouping gives the same leaves back; pytree would take tens of
        # microseconds to find that out.
        return first_structure
    flats, specs = zip(*(pytree.tree_flatten(s, is_leaf=is_distributed) for s in per_replica))
    for replica_id, spec in enumerate(specs[1:], start=1):
        if spec != specs[0]:
            raise ValueError(
                f"replicas returned different structures: replica 0 gave {specs[0]}, "
                f"replica {replica_id} gave {spec}; every replica must return the same structure"
            )
    leaves = []
    for components in zip(*flats):
        first = components[0]
        leaves.append(first if all(c is first for c in components) else wrap(components))
    return pytree.tree_unflatten(leaves, specs[0])
