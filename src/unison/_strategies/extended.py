"""StrategyExtended: tf.distribute's semantics, implemented once over a strategy's components.

Every strategy's advanced API (``strategy.extended``) is this one final class: variable
creation and tracking, reductions, broadcasts and gathers, updates, and running a step
through the replica runner. A concrete strategy only chooses components (see
``components.py``); :class:`~unison._strategies.base.Strategy` holds one
StrategyExtended and forwards its user-facing calls to it. Kept apart from ``Strategy``
because the two are read for different things: ``base.py`` for what a user calls, this
module for what those calls do with the components.
"""

from __future__ import annotations

import contextlib
import typing
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from unison._collectives.ops.base import CrossDeviceOps
from unison._devices import canonicalize, canonicalize_all
from unison._reduce import ReduceOp
from unison._state import STATE
from unison._strategies.components import StrategyComponents
from unison._values.aggregation import VariableAggregation, VariableSynchronization
from unison._values.values import DistributedValues, Mirrored, PerReplica, is_distributed, regroup, select_replica
from unison._values.variables import DistributedVariable

if TYPE_CHECKING:  # pragma: no cover
    from unison._strategies.base import Strategy

__all__ = ["StrategyExtended"]


def _same_storage(component: torch.Tensor, value: torch.Tensor) -> bool:
    return (component.device == value.device and component.shape == value.shape
            and component.data_ptr() == value.data_ptr())


@typing.final
class StrategyExtended:
    """Advanced strategy API (``tf.distribute.StrategyExtended``): reduce_to, update, devices."""

    def __init__(self, strategy: Strategy, components: StrategyComponents):
        self._strategy = strategy
        self._c = components
        # keyed by id(): tensors compare elementwise, so they cannot be set members
        self._created: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
        self._pending: list[Any] = []
        self.gradient_reduce_op = ReduceOp.MEAN

    # -- properties -----------------------------------------------------------------
    @property
    def components(self) -> StrategyComponents:
        """What this strategy is made of (runner, variable policy, gradient sync, cluster, ...)."""
        return self._c

    @property
    def worker_devices(self) -> tuple[str, ...]:
        """This worker's replica devices, one per local replica."""
        return self._c.devices

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        """Devices that hold the variables."""
        return self._c.parameter_devices

    @property
    def cross_device_ops(self) -> CrossDeviceOps:
        """The algorithm that reduces values across replicas (and workers)."""
        return self._c.cross_device_ops

    @property
    def _num_replicas_in_sync(self) -> int:
        return len(self._c.devices) * self._c.num_workers

    @property
    def should_checkpoint(self) -> bool:
        """Whether this process should write checkpoints (the chief only, in a cluster)."""
        return self._c.cluster.is_chief

    @property
    def should_save_summary(self) -> bool:
        """Whether this process should write summaries (the chief only, in a cluster)."""
        return self._c.cluster.is_chief

    @property
    def experimental_should_init(self) -> bool:
        """Whether this process should run variable initialisers (always, in eager PyTorch)."""
        return True

    @property
    def experimental_between_graph(self) -> bool:
        """True for multi-worker strategies where each worker runs its own program."""
        return self._c.between_graph

    # -- variables --------------------------------------------------------------------
    def _track(self, variable: Any) -> Any:
        self._created[id(variable)] = variable
        self._pending.append(variable)
        return variable

    def create_parameter(self, param: nn.Parameter, name: str) -> nn.Parameter | None:
        """What a module parameter registered in this strategy's scope becomes (None: itself).

        Called by the module registration hook; records the variable so that it starts
        equal on every replica and worker.
        """
        replacement = self._c.variable_policy.wrap_parameter(param, name)
        self._track(replacement if replacement is not None else param)
        return replacement

    def create_buffer(self, buffer: torch.Tensor, name: str) -> torch.Tensor | None:
        """What a module buffer registered in this strategy's scope becomes (None: itself)."""
        replacement = self._c.variable_policy.wrap_buffer(buffer, name)
        # tracked like parameters: across workers they start from the chief's values too
        self._track(replacement if replacement is not None else buffer)
        return replacement

    def create_variable(self, value: torch.Tensor, *, trainable: bool, name: str | None,
                        synchronization: VariableSynchronization, aggregation: VariableAggregation) -> torch.Tensor:
        """The variable ``unison.Variable`` creates in this strategy's scope."""
        variable = self._c.variable_policy.create(
            value, trainable=trainable, name=name, synchronization=synchronization, aggregation=aggregation
        )
        return self._track(variable)

    def finish_variable_creation(self) -> None:
        """Makes every variable created since the last call equal on all replicas and workers.

        Runs when the outermost ``scope()`` exits and before each ``run``; a parameter-server
        coordinator calls it before it schedules functions.
        """
        pending, self._pending = self._pending, []
        if pending:
            self._c.variable_policy.finish(pending)

    def discard_pending(self, variable: Any) -> None:
        """Forgets ``variable``, created in this scope and replaced before it exits (a table
        moved to the ps tasks): ``finish_variable_creation`` neither places nor broadcasts it."""
        self._pending = [v for v in self._pending if v is not variable]

    def variable_placement(self, variable: Any) -> str | list[str]:
        """Where ``variable`` lives: its device, its replicas' devices, or its ps task(s).

        ``"cpu:0"`` for a plain variable, a list of devices for a distributed one,
        ``"/job:ps/replica:0/task:K"`` (a list, one per shard, when sharded) under
        ParameterServerStrategy.

        Raises:
            ValueError: if ``variable`` was not created in this strategy's scope.
        """
        return self._c.variable_policy.placement(variable)

    def variable_created_in_scope(self, v: Any) -> bool:
        """Whether ``v`` was created inside this strategy's scope."""
        return self._created.get(id(v)) is v

    def value_container(self, value: Any) -> Any:
        """The distributed variable ``value`` is a component of, else ``value`` itself.

        A component as ``experimental_local_results(variable)`` returns it maps back to
        the variable; component 0 is a view of the variable's own storage, so components
        are recognised by their storage, not by identity.
        """
        if isinstance(value, DistributedVariable) or not isinstance(value, torch.Tensor):
            return value
        for variable in list(self._created.values()):
            if isinstance(variable, DistributedVariable) and any(_same_storage(c, value) for c in variable.values):
                return variable
        return value

    @property
    def experimental_enable_get_next_as_optional(self) -> bool:
        """Whether iterators agree across replicas and workers on the end of the data.

        True when more than one replica takes part in a step (as TF's Mirrored and
        multi-worker strategies): the last, partial global batch is split as evenly as
        possible and ``get_next_as_optional`` says whether any replica still has data.
        With one replica there is nothing to agree on.
        """
        return self._num_replicas_in_sync > 1

    @contextlib.contextmanager
    def colocate_vars_with(self, colocate_with_variable: Any) -> Iterator[None]:
        """Variables created inside live where ``colocate_with_variable`` lives.

        Under the in-process and multi-worker strategies every variable already lives on
        all of ``parameter_devices`` (mirrored, or the one central device), so the only
        thing to do is to check that the variable is one of this strategy's: a
        distributed variable it created, or a tensor on one of its parameter devices.

        Raises:
            ValueError: if the variable lives elsewhere (another strategy's, another device).
        """
        if isinstance(colocate_with_variable, DistributedVariable):
            known = self.variable_created_in_scope(colocate_with_variable)
        else:
            known = (isinstance(colocate_with_variable, torch.Tensor)
                     and canonicalize(colocate_with_variable.device) in self._c.parameter_devices)
        if not known:
            where = getattr(colocate_with_variable, "device", type(colocate_with_variable).__name__)
            raise ValueError(
                f"colocate_vars_with: {where!r} is not a variable of this strategy (parameter devices "
                f"{list(self._c.parameter_devices)!r}); pass a variable created in this strategy's scope"
            )
        yield

    # -- reductions ---------------------------------------------------------------------
    def _destination_devices(self, destinations: Any) -> tuple[str, ...]:
        if isinstance(destinations, DistributedVariable):
            return destinations.devices
        if isinstance(destinations, DistributedValues):
            return self._c.devices
        if isinstance(destinations, torch.Tensor):
            return (canonicalize(destinations.device),)
        if isinstance(destinations, (str, torch.device)):
            return (canonicalize(destinations),)
        if isinstance(destinations, (list, tuple)) and destinations:
            return canonicalize_all(destinations, field="destinations")
        raise ValueError(
            f"destinations {destinations!r} name no device: pass a device string, a tensor, a "
            f"distributed value or variable, or a list of device strings"
        )

    def _as_per_replica(self, value: Any) -> PerReplica:
        if isinstance(value, PerReplica):
            return value
        return PerReplica(value.values)

    def reduce_to(self, reduce_op: ReduceOp | str, value: Any, destinations: Any) -> Any:
        """Combines ``value`` across replicas (and workers) onto ``destinations``.

        Returns a tensor for one destination device, else a Mirrored value. A value that
        is not distributed is broadcast for MEAN (or one replica) and rejected for SUM,
        as in TensorFlow.
        """
        return self.batch_reduce_to(reduce_op, [(value, destinations)])[0]

    def batch_reduce_to(
        self, reduce_op: ReduceOp | str, value_destination_pairs: Sequence[tuple[Any, Any]]
    ) -> list[Any]:
        """``reduce_to`` for several values at once, packed into fewer transfers."""
        reduce_op = ReduceOp.from_any(reduce_op)
        pairs = list(value_destination_pairs)
        results: list[Any] = [None] * len(pairs)
        distributed = []
        # batches usually name one destination for every value: resolve it once
        named: Any = None
        devices: tuple[str, ...] = ()
        for i, (value, destinations) in enumerate(pairs):
            if destinations is not named or i == 0:
                named, devices = destinations, self._destination_devices(destinations)
            if is_distributed(value):
                distributed.append((i, self._as_per_replica(value), devices))
            elif self._c.num_workers > 1:
                # one value per worker is still one value per replica across workers
                distributed.append((i, PerReplica([torch.as_tensor(value)]), devices))
            else:
                results[i] = self._reduce_non_distributed(reduce_op, value, devices)
        if distributed:
            reduced = self._c.cross_device_ops.batch_reduce(
                reduce_op, [(v, d) for _, v, d in distributed]
            )
            for (i, _, _), r in zip(distributed, reduced):
                results[i] = r
        return results

    def _reduce_non_distributed(self, reduce_op: ReduceOp, value: Any, devices: tuple[str, ...]) -> Any:
        if reduce_op is ReduceOp.SUM and self._num_replicas_in_sync > 1:
            raise ValueError(
                f"a value that is not a DistributedValues ({type(value).__name__}) cannot be reduced with "
                f"ReduceOp.SUM over {self._num_replicas_in_sync} replicas: it is one value, not one per "
                f"replica; produce it inside strategy.run, or use ReduceOp.MEAN"
            )
        return self.broadcast_to(torch.as_tensor(value), devices)

    def broadcast_to(self, tensor: torch.Tensor, destinations: Any) -> Any:
        """Copies ``tensor`` to ``destinations`` (``tf.distribute.StrategyExtended.broadcast_to``)."""
        return self._c.cross_device_ops.broadcast(tensor, self._destination_devices(destinations))

    def gather_to(self, value: Any, axis: int, destinations: Any) -> Any:
        """Concatenates every replica's ``value`` along ``axis`` onto ``destinations``."""
        devices = self._destination_devices(destinations)
        if not is_distributed(value):
            value = PerReplica([value])
        return self._c.cross_device_ops.gather(self._as_per_replica(value), devices, axis)

    # -- updates ----------------------------------------------------------------------
    def update(self, var: Any, fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None,
               group: bool = True) -> Any:
        """Runs ``fn(component, *args, **kwargs)`` on each component of ``var``, without grad.

        ``args`` may hold Mirrored/PerReplica values; each component gets its own part.
        In replica context the update happens once, through merge_call.
        """
        kwargs = dict(kwargs or {})
        entry = STATE.top()
        if entry is not None and entry.replica_context is not None:
            return entry.replica_context.merge_call(
                lambda strategy, v, a, k: strategy.extended.update(v, fn, a, k, group), args=(var, args, kwargs)
            )
        with torch.no_grad():
            if isinstance(var, DistributedVariable):
                results = [
                    fn(c, *select_replica(i, args), **select_replica(i, kwargs)) for i, c in enumerate(var.values)
                ]
                return regroup(results, Mirrored) if group else tuple(results)
            return fn(var, *select_replica(0, args), **select_replica(0, kwargs))

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Accumulates gradients without communication (like DDP's ``no_sync``).

        Backward passes inside do not all-reduce; the first backward after the block
        synchronises the accumulated gradients. A no-op where gradients are only
        reduced at ``opt.step()`` anyway (several local replicas).
        """
        sync = self._c.gradient_sync
        return sync.no_sync() if sync is not None else contextlib.nullcontext()

    def compile_backend(self, backend: str | Callable[..., Any] = "inductor") -> Any:
        """A ``torch.compile`` backend under which gradient buckets still leave during backward.

        A compiled model's backward is one autograd node, so every gradient hook fires
        when all of it has run and the all-reduce overlaps nothing. Where this strategy's
        buckets leave during backward (MultiWorkerMirroredStrategy over gloo, or across
        hosts), the backend splits the graph at the bucket size, as DDP's ``DDPOptimizer``
        does for a DDP module (it is that class, from ``torch._dynamo``), so each piece's
        gradients reach their hooks while the rest of backward runs. Elsewhere it is
        ``backend`` itself. Call it after the model is built in ``scope()``::

            model = torch.compile(model, backend=strategy.extended.compile_backend())

        Args:
            backend: the compiler for each piece: a registered name or a backend callable.
        """
        sync = self._c.gradient_sync
        bucket_bytes = sync.overlap_bucket_bytes if sync is not None else None
        if bucket_bytes is None:
            return backend
        from torch._dynamo.backends.distributed import DDPOptimizer
        from torch._dynamo.backends.registry import lookup_backend

        compile_fn = lookup_backend(backend) if isinstance(backend, str) else backend
        # unison's first bucket is as large as the others (DDP's is smaller)
        return DDPOptimizer(bucket_bytes_cap=bucket_bytes, backend_compile_fn=compile_fn,
                            first_bucket_cap=bucket_bytes).compile_fn

    # -- running -----------------------------------------------------------------------
    def _call_for_each_replica(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if self._pending:
            self.finish_variable_creation()
        return self._c.runner.run(fn, args, kwargs)
