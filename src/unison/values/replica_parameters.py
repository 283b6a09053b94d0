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

The replica threads share the module, so a parameter *replaced* in a replica
(``torch.func.functional_call`` swaps the tensors it is given in, runs the module and
puts back what it found; ``module.weight = t``) is that replica's alone: it lives in the
replica's overlay, which its lookups see first, and putting back the variable or the
replica's component ends it. Without the overlay, the swap would change the module for
every replica at once, and putting back what the lookup returned (the component) would
leave one replica's plain tensor in place of the variable for good.
"""

from __future__ import annotations

import typing
from typing import Any

from torch import nn

from unison._state import STATE
from unison.errors import UsageError
from unison.values.variables import MirroredVariable

__all__ = ["ReplicaParameters", "resolve_in_replicas"]

_lookup = dict.__getitem__


@typing.final
class ReplicaParameters(dict):
    """A module's ``_parameters``: a mirrored variable looked up in one of its replicas is
    that replica's component, or what that replica put in its place."""

    __slots__ = ("_overlays",)

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._overlays: dict[int, dict[str, Any]] = {}  # local replica id -> name -> what it put in place

    def __getitem__(self, name: str) -> Any:
        value = _lookup(self, name)
        if isinstance(value, MirroredVariable):  # inline, not _replica_of: a forward's every parameter read
            entry = STATE.top()
            context = entry.replica_context if entry is not None else None
            if context is not None and context.strategy is value._strategy:
                replica = context.local_replica_id
                if self._overlays:  # rare: only while a replica has a parameter replaced
                    own = self._overlays.get(replica)
                    if own is not None and name in own:
                        return own[name]
                return value._component(replica)
        return value

    def __setitem__(self, name: str, value: Any) -> None:
        current = dict.get(self, name)
        replica = _replica_of(current) if isinstance(current, MirroredVariable) else None
        if replica is None:
            dict.__setitem__(self, name, value)
            return
        assert isinstance(current, MirroredVariable)
        if value is current or value is current._component(replica):  # the variable back: the overlay ends
            own = self._overlays.get(replica)
            if own is not None:
                own.pop(name, None)
                if not own:
                    del self._overlays[replica]
            return
        self._overlays.setdefault(replica, {})[name] = value

    def __delitem__(self, name: str) -> None:
        current = dict.get(self, name)
        if isinstance(current, MirroredVariable) and _replica_of(current) is not None:
            raise UsageError(
                f"`del module._parameters[{name!r}]` inside a replica: every replica thread shares the "
                f"module, so the parameter would vanish for all of them mid-step; to run the module on "
                f"other tensors, use torch.func.functional_call(module, {{{name!r}: tensor, ...}}, args), "
                f"which is per replica, or change the module outside strategy.run"
            )
        dict.__delitem__(self, name)

    def __reduce__(self) -> Any:
        return dict, (dict(self),)  # a pickled module keeps a plain dict (no unison needed to load it)


def _replica_of(variable: MirroredVariable) -> int | None:
    """This thread's local replica id when it runs a replica of ``variable``'s strategy, else None."""
    entry = STATE.top()
    context = entry.replica_context if entry is not None else None
    if context is not None and context.strategy is variable._strategy:
        return typing.cast(int, context.local_replica_id)
    return None


def resolve_in_replicas(module: nn.Module) -> None:
    """Makes ``module``'s mirrored parameters resolve to the replica's component when read
    in a replica thread (once per module; its own dict type is kept if it is not a dict)."""
    parameters = module.__dict__.get("_parameters")
    if type(parameters) is dict:
        module._parameters = ReplicaParameters(parameters)
