"""What a strategy is made of: read this file to learn what a strategy is.

A strategy (``unison.MirroredStrategy``, ``MultiWorkerMirroredStrategy``, ...) is a
final class that chooses components and hands them, as one :class:`StrategyComponents`,
to the shared :class:`~unison._strategies.extended.StrategyExtended`, which implements
the tf.distribute semantics (scope, run, reduce, update, ...) once on top of them:

- a **replica runner** runs ``strategy.run``'s function once per local replica (inline
  for one device; otherwise CPU replica 0 in the caller's thread and one thread per other
  device) and implements ``merge_call``;
- a **variable policy** decides what a parameter, buffer or ``unison.Variable`` created
  in ``scope()`` becomes (a plain tensor moved to the device, a MirroredVariable with
  mirrored or central storage, a SyncOnReadVariable) and makes new variables equal on
  every replica and worker;
- a **gradient sync** (optional) makes ``loss.backward(); opt.step()`` aggregate
  gradients over replicas and workers (``unison._gradient_sync``; its contract,
  :class:`GradientSync`, lives there, beside the step hooks that call it);
- **cross-device ops** reduce, broadcast and gather values across replicas and workers
  (``unison._collectives``); across workers they run over a **cross-worker transport**
  (packed gloo/NCCL collectives, or shared memory), chosen once;
- the **resolved cluster** says where this process sits (``unison._cluster``);
- a **tables** component gives each ``DynamicEmbedding`` built in scope its table: rows in
  this process, on the ps tasks, or a refusal naming the strategies that can hold them
  (``unison._embeddings.tables.table``).

Each contract below is a Protocol: an implementation need not import it, and lower
layers (``gradient_sync``, ``collectives``) implement them without depending on the
strategies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from unison._cluster.resolved import ResolvedCluster
from unison._collectives.ops.base import CrossDeviceOps
from unison._collectives.transport.cross_worker import CrossWorkerTransport
from unison._embeddings.tables.table import NoTables, TableFactory
from unison._gradient_sync.contract import GradientSync
from unison._values.aggregation import VariableAggregation, VariableSynchronization

__all__ = [
    "ReplicaRunner",
    "VariablePolicy",
    "GradientSync",
    "CrossWorkerTransport",
    "StrategyComponents",
    "TableFactory",
]


@runtime_checkable
class ReplicaRunner(Protocol):
    """Runs one function per local replica, each in its ReplicaContext."""

    def run(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Calls ``fn`` once per replica with that replica's part of ``args``/``kwargs``;
        returns the results regrouped (PerReplica/Mirrored, or the one result)."""
        ...


@runtime_checkable
class VariablePolicy(Protocol):
    """What a strategy makes of the variables created in its scope."""

    def wrap_parameter(self, param: nn.Parameter, name: str) -> nn.Parameter | None:
        """The parameter to register instead of ``param`` (None: keep it)."""
        ...

    def wrap_buffer(self, buffer: torch.Tensor, name: str) -> torch.Tensor | None:
        """The buffer to register instead of ``buffer`` (None: keep it)."""
        ...

    def create(self, value: torch.Tensor, *, trainable: bool, name: str | None,
               synchronization: VariableSynchronization, aggregation: VariableAggregation) -> torch.Tensor:
        """The variable ``unison.Variable(value, ...)`` returns in this strategy's scope."""
        ...

    def finish(self, variables: list) -> None:
        """Makes variables created since the last call equal on every replica and worker."""
        ...

    def placement(self, variable: Any) -> str | list[str]:
        """Where a variable this policy made lives (``strategy.extended.variable_placement``)."""
        ...


@dataclasses.dataclass(frozen=True)
class StrategyComponents:
    """The parts of one strategy; ``strategy.extended`` runs on these.

    Attributes:
        devices: this worker's replica devices, one per local replica.
        parameter_devices: the devices that hold the variables.
        cross_device_ops: reduces values across replicas (and workers).
        variable_policy: what variables created in scope become.
        runner: runs ``strategy.run``'s function per replica.
        gradient_sync: the gradient synchroniser, or None where one replica on one
            worker needs none.
        cluster: this process's place in the cluster (local for in-process strategies).
        between_graph: whether each worker runs its own program (multi-worker strategies).
        is_default: whether this is the default strategy (outside any scope).
        tables: the table a ``DynamicEmbedding`` built in scope gets (default: refused,
            as for replicas that cannot share one table's rows).
    """

    devices: tuple[str, ...]
    parameter_devices: tuple[str, ...]
    cross_device_ops: CrossDeviceOps
    variable_policy: VariablePolicy
    runner: ReplicaRunner
    gradient_sync: GradientSync | None = None
    cluster: ResolvedCluster = dataclasses.field(default_factory=ResolvedCluster.local)
    between_graph: bool = False
    is_default: bool = False
    tables: TableFactory = NoTables("this strategy")

    @property
    def num_workers(self) -> int:
        """Workers that run replicas in sync (1 for in-process strategies)."""
        return self.cluster.world_size

    @property
    def worker_index(self) -> int:
        """This worker's rank among them (0 for in-process strategies)."""
        return self.cluster.rank or 0
