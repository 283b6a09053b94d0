"""A module's mirrored parameters, read inside a replica, are that replica's plain component.

``nn.Module`` reads a parameter (``self.weight``) from its ``_parameters`` dict. Built
in a multi-replica strategy's scope, the parameter is a MirroredVariable, a tensor
subclass: every operation on it in a replica (``F.linear(x, self.weight)``) goes
through ``__torch_function__`` to find the replica's component, a few microseconds
each with the replica threads contending for the GIL (``benchmarks/in_process.py``
W2, 200 layers: about 1 ms per replica per step). ``ReplicaParameters`` takes the
place of the module's dict and answers a lookup made in a replica thread of the
variable's strategy with the replica's component, a plain leaf tensor, which the
operations then use directly: what dispatch would have resolved to, once per lookup
instead of once per operation. Anywhere else a lookup returns the variable, and
iteration (``parameters()``, ``state_dict()``, ``to()``) always sees the variables.

One difference to reading through the variable: an in-place write through the
attribute inside a replica (``self.weight.add_(x)`` in ``forward``) writes that
replica's copy only, where the variable would aggregate it across replicas (or refuse
it). Write a mirrored variable through the variable (``model.parameters()``,
``assign``, ``strategy.extended.update``), as in TensorFlow.
"""

from __future__ import annotations

import typing
from typing import Any

from torch import nn

from unison._state import STATE
from unison.values.variables import MirroredVariable

__all__ = ["ReplicaParameters", "resolve_in_replicas"]

_lookup = dict.__getitem__


@typing.final
class ReplicaParameters(dict):
    """A module's ``_parameters``: a mirrored variable looked up in one of its replicas is
    that replica's component."""

    __slots__ = ()

    def __getitem__(self, name: str) -> Any:
        value = _lookup(self, name)
        if isinstance(value, MirroredVariable):
            entry = STATE.top()
            context = entry.replica_context if entry is not None else None
            if context is not None and context.strategy is value._strategy:
                return value._component(context.local_replica_id)
        return value

    def __reduce__(self) -> Any:
        return dict, (dict(self),)  # a pickled module keeps a plain dict (no unison needed to load it)


def resolve_in_replicas(module: nn.Module) -> None:
    """Makes ``module``'s mirrored parameters resolve to the replica's component when read
    in a replica thread (once per module; its own dict type is kept if it is not a dict)."""
    parameters = module.__dict__.get("_parameters")
    if type(parameters) is dict:
        module._parameters = ReplicaParameters(parameters)
