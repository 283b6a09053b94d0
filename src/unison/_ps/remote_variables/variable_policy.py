"""The variable policy of ParameterServerStrategy: parameters become ps variables.

A parameter registered in the strategy's scope (or a ``unison.Variable``) is given a
place — whole on one ps task, or split by the strategy's partitioner into shards on
several — and returned as a :class:`~unison._ps.remote_variables.ps_variables.PSVariable` or
:class:`~unison._ps.remote_variables.ps_variables.ShardedVariable` holding its initial values. When the
scope exits, ``finish`` sends every new variable to its ps tasks (one request per ps
task) and drops the local values.

Placement is round-robin over ps tasks in creation order (TensorFlow's rule), each
shard taking the next task; a placer passed to the strategy replaces the rule (e.g.
tensorpack's least-loaded rule, :class:`~unison.tensorpack.LeastLoadedDeviceSetter`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from unison._collectives import LeastLoadedDeviceSetter
from unison._interpose.module_hooks import observed_registrations
from unison._ps.remote_variables.ps_variables import PSVariable, ShardedVariable, _RemoteParameter
from unison._ps.remote_variables.shard_partitioners import shard_rows
from unison._ps.remote_variables.variable_specs import Placement, VariableSpec
from unison._ps.wire import protocol as wire
from unison._ps.wire.client import PSClient
from unison._values.aggregation import VariableAggregation, VariableSynchronization

__all__ = ["PSVariablePolicy", "make_placer"]

#: A placer gets a new variable's (or shard's) element count and returns a ps task index.
Placer = Callable[[int], int]


def make_placer(placer: Any, num_ps: int) -> Placer:
    """A placer from ``None`` (round-robin), ``"round_robin"``, ``"least_loaded"`` or a callable.

    Raises:
        ValueError: for another string.
        TypeError: for a non-callable.
    """
    if placer is None or placer == "round_robin":
        counter = itertools.count()
        return lambda numel: next(counter) % num_ps
    if placer == "least_loaded":
        setter = LeastLoadedDeviceSetter(None, list(range(num_ps)))
        return setter.place_with_balance
    if isinstance(placer, str):
        raise ValueError(f"variable_placer {placer!r} is unknown; use 'round_robin', 'least_loaded' or a callable")
    if not callable(placer):
        raise TypeError(f"variable_placer must be callable (element count -> ps index), got {placer!r}")
    return placer


class PSVariablePolicy:
    """Makes parameters and variables ps variables; sends them to the ps tasks at ``finish``.

    Args:
        ps_addresses: the ps tasks' addresses.
        authkey: the cluster's key (called lazily: the key is only needed to connect).
        timeout: seconds to wait for a ps task.
        partitioner: ``partitioner(shape, dtype) -> shards per axis``, or None.
        placer: see :func:`make_placer`.
    """

    def __init__(self, ps_addresses: list[str], authkey: Callable[[], bytes], timeout: float,
                 partitioner: Any = None, placer: Any = None):
        self._ps_addresses = list(ps_addresses)
        self._authkey = authkey
        self._timeout = timeout
        self._partitioner = partitioner
        self._place = make_placer(placer, len(ps_addresses))
        self._ids = itertools.count()
        self._client: PSClient | None = None
        self._override: list[tuple[Callable[[str], int], list[_RemoteParameter]]] = []

    @property
    def client(self) -> PSClient:
        """The coordinator's connections to the ps tasks (opened on first use)."""
        if self._client is None:
            self._client = PSClient(self._ps_addresses, self._authkey(), timeout=self._timeout,
                                    reply_timeout=self._timeout)
        return self._client

    def _task(self, numel: int) -> int:
        task = self._place(numel)
        if isinstance(task, bool) or not isinstance(task, int) or not 0 <= task < len(self._ps_addresses):
            raise ValueError(f"the variable placer returned {task!r}; it must return a ps task index in "
                             f"0..{len(self._ps_addresses) - 1}")
        return task

    def _spec(self, value: torch.Tensor, name: str, requires_grad: bool, partition: bool = True) -> VariableSpec:
        shape, uid = tuple(value.shape), next(self._ids)
        shards = 1
        if partition and self._partitioner is not None and value.dim() > 0 and shape[0] > 1:
            shards = int(self._partitioner(shape, value.dtype)[0])
        row_numel = math.prod(shape[1:]) if shape else 1
        rows = shard_rows(shape[0], shards) if shape else [1]
        parts = tuple(Placement(self._task(r * row_numel), f"{uid}:{name}" + (f"/part_{i}" if shards > 1 else ""), r)
                      for i, r in enumerate(rows))
        return VariableSpec(name, shape, value.dtype, requires_grad, parts, shards > 1)

    def _make(self, value: torch.Tensor, name: str, requires_grad: bool, partition: bool = True) -> _RemoteParameter:
        spec = self._spec(value, name, requires_grad, partition)
        cls = ShardedVariable if spec.sharded else PSVariable
        variable = cls._create(value.detach(), requires_grad, spec, self)
        for _, created in self._override:
            created.append(variable)
        return variable

    # -- the variable-policy interface --------------------------------------------------
    def wrap_parameter(self, param: nn.Parameter, name: str) -> nn.Parameter:
        """A ps variable in place of ``param`` (its values stay local until ``finish``)."""
        if isinstance(param, _RemoteParameter):
            return param
        return self._make(param, name, param.requires_grad)

    def wrap_buffer(self, buffer: torch.Tensor, name: str) -> _RemoteParameter:
        """A whole (never partitioned) non-trainable ps variable in place of ``buffer``.

        Workers pull it with the parameters; what a scheduled function changes in it
        (BatchNorm's running statistics, its batch count) is added on the ps task when
        the function ends (see ``WorkerRuntime.push_changes``).
        """
        if isinstance(buffer, _RemoteParameter):
            return buffer
        return self._make(buffer, name, False, partition=False)

    def create(self, value: torch.Tensor, *, trainable: bool, name: str | None,
               synchronization: VariableSynchronization, aggregation: VariableAggregation) -> _RemoteParameter:
        """``unison.Variable`` in scope: a ps variable."""
        return self._make(value, name or "Variable", trainable and value.is_floating_point())

    def finish(self, variables: list) -> None:
        """Sends every new ps variable to its ps tasks, one request per ps task."""
        pending = [v for v in variables if isinstance(v, _RemoteParameter) and not v._ps_remote]
        if not pending:
            return
        placed, values = [], []
        for variable in pending:
            with torch._C.DisableTorchFunctionSubclass():
                full = variable.detach()
                if isinstance(variable, ShardedVariable):
                    variable._make_shards()
                pieces = torch.split(full, [p.rows for p in variable._ps_spec.parts], dim=0) if full.dim() else [full]
                for part, piece in zip(variable._ps_spec.parts, pieces):
                    placed.append((part.task, part.key))
                    values.append(piece.contiguous())
        self.client.write(wire.Create, placed, values)
        for variable in pending:
            if isinstance(variable, ShardedVariable):
                for shard in variable.variables:
                    shard._become_remote()
            variable._become_remote()

    # -- explicit placement -----------------------------------------------------------------
    @property
    def connected_client(self) -> PSClient | None:
        """The client to the ps tasks if it has connected, else None (nothing to close)."""
        return self._client

    def placement(self, variable: Any) -> str | list[str]:
        """``"/job:ps/replica:0/task:K"`` for a variable, a list (one per shard) for a ShardedVariable.

        Raises:
            ValueError: if ``variable`` is not a ps variable.
        """
        if isinstance(variable, _RemoteParameter):
            return variable.placement
        raise ValueError(f"{type(variable).__name__} was not created in a ParameterServerStrategy's scope; "
                         f"it has no ps placement")

    @contextlib.contextmanager
    def place_parameters_in(self, assign: Callable[[str], int]) -> Iterator[None]:
        """Parameters (and buffers) created inside go to ps task ``assign(name)`` (see the strategy's extended)."""
        created: list[_RemoteParameter] = []
        modules: list[nn.Module] = []
        children: set[int] = set()

        def on_module(module: nn.Module, name: str, submodule: Any) -> None:
            modules.append(module)
            if submodule is not None:
                children.add(id(submodule))

        def on_parameter(module: nn.Module, name: str, param: Any) -> None:
            modules.append(module)

        with observed_registrations(on_module=on_module, on_parameter=on_parameter):
            self._override.append((assign, created))
            try:
                yield
            finally:
                self._override.remove((assign, created))
        pending = {id(v): v for v in created if not v._ps_remote}
        seen: set[int] = set()
        for module in modules:
            if id(module) in children or id(module) in seen:
                continue
            seen.add(id(module))
            for name, param in itertools.chain(module.named_parameters(), module.named_buffers()):
                if id(param) in pending:
                    variable = pending[id(param)]
                    task = assign(name)
                    if isinstance(task, bool) or not isinstance(task, int) or not 0 <= task < len(self._ps_addresses):
                        raise ValueError(f"place_parameters_in: assign({name!r}) returned {task!r}; it must be a "
                                         f"ps task index in 0..{len(self._ps_addresses) - 1}")
                    spec = variable._ps_spec
                    variable._ps_spec = dataclasses.replace(
                        spec, parts=tuple(dataclasses.replace(p, task=task) for p in spec.parts))
                    del pending[id(param)]
