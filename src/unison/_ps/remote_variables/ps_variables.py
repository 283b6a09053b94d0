"""Variables that live on ps tasks, as the coordinator sees them.

A parameter created in a ``ParameterServerStrategy``'s scope becomes a
:class:`PSVariable` (or, when the strategy's partitioner splits it, a
:class:`ShardedVariable`). Both are ``nn.Parameter`` subclasses, so modules and
``torch.optim`` optimizers accept them. Until the scope exits they hold their initial
values locally (module initialisers run in place after registration); then the values
move to the ps tasks and the local tensor keeps only its shape (a stride-0 view of one
element). From then on every use on the coordinator — ``state_dict()``, printing,
arithmetic, ``unison.save_checkpoint`` — reads the current values from the ps tasks,
and in-place writes (``copy_`` from ``load_state_dict``) write them there.

When a function scheduled with a ClusterCoordinator is sent to a worker, a variable
travels as its :class:`~unison._ps.remote_variables.variable_specs.VariableSpec` only; the worker rebuilds it
from its own cache (see :mod:`unison._ps.worker.runtime`).

tf.distribute equivalent: variables created under ``ParameterServerStrategy.scope()``
and ``tf.distribute.experimental.partitioners``' ``ShardedVariable``.
"""

from __future__ import annotations

import abc
import typing
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from unison._ps.remote_variables.variable_specs import VariableSpec, is_metadata_function, task_device
from unison._ps.wire import protocol as wire
from unison._ps.wire.worker_references import WorkerReference, reference
from unison._state import STATE

__all__ = ["PSVariable", "ShardedVariable"]

def _is_in_place(func: Callable[..., Any]) -> bool:
    name = getattr(func, "__name__", "")
    return name == "__setitem__" or (name.endswith("_") and not name.startswith("_"))


class _RemoteParameter(nn.Parameter):
    """Shared machinery of coordinator-side ps variables: reads and writes go to the ps tasks (abstract).

    (A tensor subclass: its metaclass is torch's, not ``ABCMeta``; the architecture
    tests check that the concrete variables implement ``placement``.)
    """

    @property
    @abc.abstractmethod
    def placement(self) -> str | list[str]:
        """Where the variable lives: a ps task's device name, or one per shard."""

    _ps_spec: VariableSpec
    _ps_owner: Any
    _ps_remote: bool

    @classmethod
    def _create(cls, data: torch.Tensor, requires_grad: bool, spec: VariableSpec, owner: Any) -> Any:
        variable = cls(data.detach(), requires_grad)
        variable._ps_spec, variable._ps_owner, variable._ps_remote = spec, owner, False
        return variable

    # -- reading and writing --------------------------------------------------------
    def read_value(self) -> torch.Tensor:
        """The current value (from the ps tasks once the variable is placed), as a plain tensor."""
        with torch._C.DisableTorchFunctionSubclass():
            if not self._ps_remote:
                return self.detach().clone()
        return self._read_remote()

    def assign(self, value: Any) -> _RemoteParameter:
        """Writes ``value`` (broadcast to the shape) to the variable; returns it."""
        with torch._C.DisableTorchFunctionSubclass():
            full = torch.as_tensor(value, dtype=self.dtype).expand(self.shape).contiguous()
            if not self._ps_remote:
                with torch.no_grad():
                    self.copy_(full)
                return self
        self._write_remote(full)
        return self

    def _read_remote(self) -> torch.Tensor:
        raise NotImplementedError

    def _write_remote(self, value: torch.Tensor) -> None:
        raise NotImplementedError

    def _become_remote(self) -> None:
        """Drops the local values once they are on the ps tasks (the shape stays)."""
        with torch._C.DisableTorchFunctionSubclass():
            self.data = torch.zeros((), dtype=self.dtype).expand(self.shape)
        self._ps_remote = True

    # -- torch integration -------------------------------------------------------------
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        remote = [a for a in (*args, *kwargs.values()) if isinstance(a, _RemoteParameter) and a._ps_remote]
        if not remote or is_metadata_function(func):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name == "__set__" and args and isinstance(args[0], _RemoteParameter):  # `.data = value`
            args[0]._write_remote(torch.as_tensor(args[1]))
            return None
        if _is_in_place(func) and args and isinstance(args[0], _RemoteParameter) and args[0]._ps_remote:
            target = args[0]
            value = target._read_remote()
            rest = tree_map(lambda a: a.read_value() if isinstance(a, _RemoteParameter) else a, (args[1:], kwargs))
            with torch._C.DisableTorchFunctionSubclass():
                func(value, *rest[0], **rest[1])
            target._write_remote(value)
            return target
        args, kwargs = tree_map(lambda a: a.read_value() if isinstance(a, _RemoteParameter) else a, (args, kwargs))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def _check_sendable(self) -> None:
        if not self._ps_remote:
            raise TypeError(
                f"ps variable {self._ps_spec.name!r} cannot be pickled before the strategy's scope exits "
                f"(its values are not on the ps tasks yet); schedule functions after `with strategy.scope():`"
            )

    def __reduce_ex__(self, protocol: Any) -> tuple:
        """In a scheduled function: the worker's cached parameter (:mod:`unison._ps.wire.worker_references`)."""
        self._check_sendable()
        return reference(WorkerReference.VARIABLE, self._ps_spec)

    def __deepcopy__(self, memo: dict) -> nn.Parameter:
        # In the strategy's scope (a module that clones its layers there, like
        # nn.TransformerEncoder), the copy is a new ps variable; elsewhere it is a local
        # snapshot: a plain parameter holding the current values (for evaluation or export).
        copy = nn.Parameter(self.read_value(), requires_grad=self.requires_grad)
        entry = STATE.top()
        if (entry is not None and entry.replica_context is None
                and entry.strategy.extended.components.variable_policy is self._ps_owner):
            extended, name = entry.strategy.extended, self._ps_spec.name
            # a trainable copy may be partitioned like a parameter; a buffer's stays whole
            copy = extended.create_parameter(copy, name) if self.requires_grad else extended.create_buffer(copy, name)
        memo[id(self)] = copy
        return copy

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"{type(self).__name__}({self._ps_spec.name!r}, on {self._placement_text()}):\n{self.read_value()!r}"

    def _placement_text(self) -> str:
        raise NotImplementedError


@typing.final
class PSVariable(_RemoteParameter):
    """A whole variable on one ps task (created by ``ParameterServerStrategy.scope()``)."""

    @property
    def device_name(self) -> str:
        """``"/job:ps/replica:0/task:K"``: where the variable lives."""
        return task_device(self._ps_spec.parts[0].task)

    @property
    def placement(self) -> str:
        """The same as ``device_name``."""
        return self.device_name

    def _read_remote(self) -> torch.Tensor:
        part = self._ps_spec.parts[0]
        return self._ps_owner.client.read([(part.task, part.key)])[0]

    def _write_remote(self, value: torch.Tensor) -> None:
        part = self._ps_spec.parts[0]
        value = value.to(self._ps_spec.dtype).expand(self._ps_spec.shape).contiguous()
        self._ps_owner.client.write(wire.Assign, [(part.task, part.key)], [value])

    def _placement_text(self) -> str:
        return self.device_name


@typing.final
class ShardedVariable(_RemoteParameter):
    """A variable split along axis 0 into shards on different ps tasks.

    Created in ``ParameterServerStrategy.scope()`` when the strategy's
    ``variable_partitioner`` asks for more than one shard. Shard ``i`` holds rows
    ``[start_i, start_i + rows_i)``; the first ``rows % n`` shards are one row longer.
    ``nn.Embedding`` and ``nn.Linear`` work with it unchanged: on a worker an embedding
    lookup pulls only the rows its batch touches and pushes only their gradients.
    Reading it on the coordinator (``state_dict()``, ``read_value()``) gives the whole
    tensor, so a checkpoint loads into a plain module.

    tf.distribute equivalent: ``tf.distribute.experimental.ShardedVariable``.
    """

    _ps_shards: tuple[PSVariable, ...]

    @property
    def variables(self) -> tuple[PSVariable, ...]:
        """The shards, in row order."""
        return self._ps_shards

    @property
    def device_names(self) -> list[str]:
        """Where each shard lives, e.g. ``["/job:ps/replica:0/task:0", "/job:ps/replica:0/task:1"]``."""
        return [task_device(p.task) for p in self._ps_spec.parts]

    @property
    def placement(self) -> list[str]:
        """The same as ``device_names``."""
        return self.device_names

    def _make_shards(self) -> None:
        with torch._C.DisableTorchFunctionSubclass():
            full = self.detach()
            shards, start = [], 0
            for index, part in enumerate(self._ps_spec.parts):
                spec = VariableSpec(f"{self._ps_spec.name}/part_{index}", self._ps_spec.part_shape(index),
                                    self._ps_spec.dtype, self._ps_spec.requires_grad, (part,), False)
                shards.append(
                    PSVariable._create(full[start:start + part.rows], self.requires_grad, spec, self._ps_owner)
                )
                start += part.rows
        self._ps_shards = tuple(shards)

    def _read_remote(self) -> torch.Tensor:
        parts = [(p.task, p.key) for p in self._ps_spec.parts]
        return torch.cat(self._ps_owner.client.read(parts), dim=0)

    def _write_remote(self, value: torch.Tensor) -> None:
        value = value.to(self._ps_spec.dtype).expand(self._ps_spec.shape).contiguous()
        pieces = list(torch.split(value, [p.rows for p in self._ps_spec.parts], dim=0))
        self._ps_owner.client.write(wire.Assign, [(p.task, p.key) for p in self._ps_spec.parts], pieces)

    def _placement_text(self) -> str:
        return ", ".join(self.device_names)
