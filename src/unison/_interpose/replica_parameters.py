"""A module's mirrored parameters (and distributed buffers), read inside a replica, are that replica's plain component.

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

Buffers are answered the same way (a module built in scope gets a ``ReplicaParameters``
as ``_buffers`` too): a floating buffer there is a SyncOnReadVariable, which every replica
reads and writes as its own component anyway (``BatchNorm``'s running statistics), so
the lookup gives what dispatch would have. Without it ``torch.compile`` traced the
variable's ``__torch_function__``, broke the graph inside it and handed the tensor
subclass to AOTAutograd, which failed ("Multiple dispatch failed for aten.add.Tensor").

Under ``torch.compile`` a lookup in cross-replica context (a compiled model called outside
``strategy.run``) gives a mirrored variable's component 0 too, the plain tensor an eager
read there resolves to, so Dynamo does not trace the variable's ``__torch_function__``
(a graph break at each of its Python branches). A read whose value is not a plain tensor
there (a sync-on-read buffer read outside ``run``: the replicas' aggregate) raises a
UsageError naming the ways out (``_refuse_to_compile``).
"""

from __future__ import annotations

import copy
import typing
from typing import Any

import torch
from torch import nn

from unison._interpose.registry import InstanceInterposition
from unison._state import STATE
from unison._values.variables import DistributedVariable, MirroredVariable
from unison.errors import UsageError

__all__ = ["ReplicaParameters", "replica_parameter_dicts", "resolve_in_replicas"]

_eval_frame_callback = torch._C._dynamo.eval_frame.get_eval_frame_callback


@typing.final
class ReplicaParameters(dict):
    """A module's ``_parameters`` (or ``_buffers``): a distributed variable looked up in one of
    its replicas is that replica's component, or what that replica put in its place."""

    __slots__ = ("_overlays",)

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._overlays: dict[int, dict[str, Any]] = {}  # local replica id -> name -> what it put in place

    def __getitem__(self, name: str) -> Any:
        # `dict.__getitem__` spelled out, not a module-level alias of it: torch.compile
        # (Dynamo) traces this lookup only when it sees the builtin by that name; through an
        # alias every parameter read was a graph break. Traced, the replica id below becomes
        # a guard, so a compiled module gets one graph per replica (tests/values/test_torch_compile.py).
        value = dict.__getitem__(self, name)
        if isinstance(value, DistributedVariable):  # inline, not _replica_of: a forward's every parameter read
            entry = STATE.top()
            context = entry.replica_context if entry is not None else None
            if context is not None and context.strategy is value.distribute_strategy:
                replica = context.local_replica_id
                if self._overlays:  # rare: only while a replica has a parameter replaced
                    own = self._overlays.get(replica)
                    if own is not None and name in own:
                        return own[name]
                component = value.component(replica)
                if component is value and _in_compiled_region():
                    _refuse_to_compile(value, name, f"inside replica 0 of {type(value.distribute_strategy).__name__}")
                return component
            if _in_compiled_region():  # cross-replica: what a read there resolves to, if it is a plain tensor
                if not isinstance(value, MirroredVariable) or value._cross_replica_value() is value:
                    _refuse_to_compile(value, name, "in cross-replica context (outside strategy.run)")
                return value._cross_replica_value()  # component 0, as an eager read there
        return value

    def __setitem__(self, name: str, value: Any) -> None:
        current = dict.get(self, name)
        replica = _replica_of(current) if isinstance(current, DistributedVariable) else None
        if replica is None:
            dict.__setitem__(self, name, value)
            return
        assert isinstance(current, DistributedVariable)
        if value is current or value is current.component(replica):  # the variable back: the overlay ends
            own = self._overlays.get(replica)
            if own is not None:
                own.pop(name, None)
                if not own:
                    del self._overlays[replica]
            return
        self._overlays.setdefault(replica, {})[name] = value

    def __delitem__(self, name: str) -> None:
        current = dict.get(self, name)
        if isinstance(current, DistributedVariable) and _replica_of(current) is not None:
            raise UsageError(
                f"`del module._parameters[{name!r}]` inside a replica: every replica thread shares the "
                f"module, so the parameter would vanish for all of them mid-step; to run the module on "
                f"other tensors, use torch.func.functional_call(module, {{{name!r}: tensor, ...}}, args), "
                f"which is per replica, or change the module outside strategy.run"
            )
        dict.__delitem__(self, name)

    def __reduce__(self) -> Any:
        return dict, (dict(self),)  # a pickled module keeps a plain dict (no unison needed to load it)

    def __deepcopy__(self, memo: dict) -> ReplicaParameters:
        # a deep-copied module's variables are new variables of the same strategy (their
        # __deepcopy__): its replicas must read their own components too
        copied = ReplicaParameters()
        memo[id(self)] = copied
        for name, value in dict.items(self):
            dict.__setitem__(copied, name, copy.deepcopy(value, memo))
        return copied


def _in_compiled_region() -> bool:
    """Whether this runs under ``torch.compile``: traced by Dynamo, or run eagerly inside a
    compiled call (where Dynamo fell back after a graph break). Tracing alone is not enough:
    Dynamo turns an exception raised while it traces into a graph break and runs the code
    again eagerly. The test is the one ``torch.compiler.set_stance`` uses."""
    if torch.compiler.is_compiling():
        return True
    callback = _eval_frame_callback()
    return callback is not None and callback is not False


def _refuse_to_compile(variable: DistributedVariable, name: str, where: str) -> None:
    """Raises the error of a compiled module reading a distributed variable whose value there
    is not a plain tensor: a sync-on-read buffer (BatchNorm's running statistics) in
    cross-replica context, where it reads the replicas' aggregate, or a variable whose
    component is the variable itself (none today: every component 0 is a plain alias).

    Dynamo would trace the variable's ``__torch_function__``, break the graph inside it and
    hand the tensor subclass to AOTAutograd, which fails with "Multiple dispatch failed for
    aten..." at the first step. This names the module attribute and the ways out instead.
    """
    raise UsageError(
        f"torch.compile cannot run a module that reads its {type(variable).__name__} {name!r} {where}: "
        f"there it is the tensor subclass itself, which Dynamo/AOTAutograd cannot take as a graph "
        f"input. Call the compiled module inside strategy.run, or run this model uncompiled under "
        f"{type(variable.distribute_strategy).__name__}, or compile it with one replica per process "
        f"(MultiWorkerMirroredStrategy with one device per worker, or OneDeviceStrategy)"
    )


def _replica_of(variable: DistributedVariable) -> int | None:
    """This thread's local replica id when it runs a replica of ``variable``'s strategy, else None."""
    entry = STATE.top()
    context = entry.replica_context if entry is not None else None
    if context is not None and context.strategy is variable.distribute_strategy:
        return typing.cast(int, context.local_replica_id)
    return None


def _replace_dicts(module: nn.Module) -> None:
    parameters = module.__dict__.get("_parameters")
    if type(parameters) is dict:
        module._parameters = ReplicaParameters(parameters)
    buffers = module.__dict__.get("_buffers")
    if type(buffers) is dict:
        module._buffers = ReplicaParameters(buffers)


replica_parameter_dicts = InstanceInterposition(
    "a module's _parameters and _buffers dicts answering a replica with its component",
    "nn.Module instances built in a multi-replica strategy's scope (the instance's two dicts)",
    "every operation on a mirrored variable in a replica goes through __torch_function__; a lookup that gives the "
    "replica's plain component resolves it once per read instead of once per operation",
    _replace_dicts)


def resolve_in_replicas(module: nn.Module) -> None:
    """Makes ``module``'s mirrored parameters and distributed buffers resolve to the replica's
    component when read in a replica thread (once per module; its own dict types are kept
    where they are not dicts)."""
    if type(module.__dict__.get("_parameters")) is dict or type(module.__dict__.get("_buffers")) is dict:
        replica_parameter_dicts(module)
