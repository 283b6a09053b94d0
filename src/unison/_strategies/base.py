"""Strategy: the API every strategy shares.

A concrete strategy only chooses components — replica devices, a replica runner, a
CrossDeviceOps, a variable policy, a gradient synchroniser, and its place in a
cluster (see ``components.py``) — and hands them to :class:`StrategyExtended`
(``extended.py``), which implements the tf.distribute semantics once on top of them.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils import _pytree as pytree

from unison._devices import is_cuda, torch_device
from unison._gradient_sync.step_hooks import install_step_hooks
from unison._input.context import ValueContext
from unison._input.dataset import DistributedDataset, DistributedDatasetsFromFunction
from unison._interpose.initial_draws import any_mode_active, cpu_drawn_fills, steps_without_fills
from unison._reduce import ReduceOp
from unison._state import STATE
from unison._strategies.components import StrategyComponents
from unison._strategies.extended import StrategyExtended
from unison._strategies.scope_hooks import install_scope_hooks
from unison._values.values import DistributedValues, PerReplica, regroup

if TYPE_CHECKING:  # pragma: no cover
    from unison._cluster.base import ClusterResolver

__all__ = ["Strategy", "StrategyExtended", "HOST"]

HOST = "cpu:0"


class Strategy(abc.ABC):
    """Distributes a computation over devices and workers (``tf.distribute.Strategy``).

    Create the model and optimizer inside ``scope()``, then call ``run(step_fn, args)``;
    ``reduce`` brings per-replica results back to the host. Abstract: each concrete
    strategy is final and differs only by the components it hands to ``__init__``.
    """

    def __init__(self, components: StrategyComponents):
        self._extended = StrategyExtended(self, components)

    @property
    @abc.abstractmethod
    def cluster_resolver(self) -> ClusterResolver | None:
        """The resolver the cluster came from; None for strategies that run in one process."""

    def __reduce__(self) -> tuple:
        # Copies and pickles (the distribute coordinator makes both) are rebuilt from the
        # constructor's arguments: threads, weak references and groups do not travel.
        init_args = getattr(self, "_init_args", None)
        if init_args is None:
            raise TypeError(f"{type(self).__name__} cannot be copied or pickled")
        return type(self), init_args

    @property
    def extended(self) -> StrategyExtended:
        """The advanced API: reduce_to, batch_reduce_to, update, devices."""
        return self._extended

    @property
    def num_replicas_in_sync(self) -> int:
        """Replicas that take part in each step, across all workers."""
        return self._extended._num_replicas_in_sync

    @contextlib.contextmanager
    def scope(self) -> Iterator[Strategy]:
        """Makes this strategy current: variables and modules created inside are distributed.

        Raises:
            ValueError: if another (non-default) strategy's scope is already open in this thread.
        """
        top = STATE.top()
        if top is not None and top.strategy is not self and not top.strategy.extended.components.is_default:
            raise ValueError(
                f"cannot enter the scope of {type(self).__name__} inside the scope of a different strategy "
                f"({type(top.strategy).__name__}): strategies cannot be nested or mixed; exit the outer "
                f"`with strategy.scope():` first, or use the same strategy object"
            )
        install_scope_hooks()
        if self._extended.components.gradient_sync is not None:  # else opt.step() has nothing to find
            install_step_hooks()
        replica_context = top.replica_context if top is not None and top.strategy is self else None
        outermost = top is None or top.strategy is not self
        draws = cpu_drawn_fills() if outermost and self._draws_off_the_cpu() else contextlib.nullcontext()
        with STATE.push(self, replica_context), draws:
            try:
                yield self
            finally:
                if outermost:
                    self._extended.finish_variable_creation()

    def _draws_off_the_cpu(self) -> bool:
        """Whether variables live on GPUs, where their random fills are redirected (``initial_draws``)."""
        devices = self._extended.worker_devices + self._extended.parameter_devices
        return any(is_cuda(d) for d in devices)

    def run(self, fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None) -> Any:
        """Runs ``fn(*args, **kwargs)`` once per replica and returns PerReplica results.

        PerReplica arguments are unwrapped to each replica's component. Exceptions from
        any replica (or a merge function) are raised here, after every replica stopped.
        """
        # Few frames on purpose: run costs a one-device step 3-5 us (benchmarks/RESULTS.md, 'Where
        # the remaining goals' time goes', OneDevice on D).
        if self._extended.components.gradient_sync is not None:  # one device: no hook in opt.step() at all
            install_step_hooks()
        stack = STATE.stack()
        if stack and stack[-1].strategy is not self and not stack[-1].strategy.extended.components.is_default:
            with self.scope():  # raises: strategies cannot be nested or mixed
                pass
        # No scope of its own: each replica runs in its replica context (pushed by the
        # runner), merge functions in cross-replica context, and variables cannot be
        # created inside run, so a scope would only cost time on every step.
        if any_mode_active():  # a GPU scope's initial-draws mode: not in steps
            with steps_without_fills():
                return self._extended._call_for_each_replica(fn, args, dict(kwargs) if kwargs else {})
        return self._extended._call_for_each_replica(fn, args, dict(kwargs) if kwargs else {})

    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | None = None) -> torch.Tensor:
        """Reduces per-replica ``value`` across all replicas to one tensor on the host.

        With ``axis``, each component is first reduced along that axis; for MEAN the
        result is the mean over all elements along ``axis`` of all replicas.
        """
        reduce_op = ReduceOp.from_any(reduce_op)
        if axis is None:
            return self._extended.reduce_to(reduce_op, value, HOST)
        components = self.experimental_local_results(value)
        sums = PerReplica([c.sum(dim=axis) for c in components])
        total = self._extended.reduce_to(ReduceOp.SUM, sums, HOST)
        if reduce_op is ReduceOp.SUM:
            return total
        counts = PerReplica([torch.tensor(float(c.shape[axis]), device=c.device) for c in components])
        count = self._extended.reduce_to(ReduceOp.SUM, counts, HOST)
        return total / count

    def gather(self, value: Any, axis: int) -> torch.Tensor:
        """Concatenates every replica's ``value`` along ``axis`` into one tensor on the host."""
        return self._extended.gather_to(value, axis, HOST)

    def experimental_distribute_values_from_function(self, value_fn: Callable[[Any], Any]) -> Any:
        """One value per local replica: ``value_fn(ValueContext)`` called once for each.

        Tensors ``value_fn`` returns are moved to that replica's device. Returns a
        PerReplica (the one value with a single local replica), ready for ``run``.

        tf.distribute equivalent: ``Strategy.experimental_distribute_values_from_function``.
        """
        if not callable(value_fn):
            raise TypeError(f"value_fn must be callable, got {type(value_fn).__name__}: {value_fn!r}")
        components = self._extended.components
        first = components.worker_index * len(components.devices)
        values = []
        for i, device in enumerate(components.devices):
            value = value_fn(ValueContext(first + i, self.num_replicas_in_sync))
            values.append(pytree.tree_map(
                lambda leaf, d=device: leaf.to(torch_device(d)) if isinstance(leaf, torch.Tensor) else leaf, value))
        return regroup(values)

    @contextlib.contextmanager
    def colocate_vars_with(self, colocate_with_variable: Any) -> Iterator[None]:
        """Variables created inside live where ``colocate_with_variable`` lives
        (see ``extended.colocate_vars_with``)."""
        with self._extended.colocate_vars_with(colocate_with_variable), self.scope():
            yield

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """The components of ``value`` on this worker's replicas, as a tuple."""
        if isinstance(value, DistributedValues):
            return tuple(value.values)
        return (value,)

    def configure(  # noqa: B027 - a no-op default that subclasses may override
        self, cluster_spec: Any = None, task_type: str | None = None, task_id: int | None = None,
        rendezvous: str | None = None,
    ) -> None:
        """Connects the strategy to a cluster (used by the distribute coordinator; ``rendezvous``
        is the ``host:port`` of a store opened for the workers' process group, or None).

        In-process strategies ignore the cluster, as TensorFlow's do.
        """

    def experimental_distribute_dataset(self, dataset: Any, options: Any = None, **kwargs: Any) -> Any:
        """Distributes a dataset of *global* batches over this strategy's replicas."""
        components = self._extended.components
        return DistributedDataset(
            dataset, num_workers=components.num_workers, worker_index=components.worker_index,
            devices=components.devices, options=options, agree=components.cross_device_ops.agree,
            **kwargs,
        )

    def distribute_datasets_from_function(self, dataset_fn: Callable[..., Any], options: Any = None) -> Any:
        """Calls ``dataset_fn(InputContext)`` once per input pipeline (worker) and distributes the result."""
        components = self._extended.components
        return DistributedDatasetsFromFunction(
            dataset_fn, num_workers=components.num_workers, worker_index=components.worker_index,
            devices=components.devices, num_replicas_in_sync=self.num_replicas_in_sync,
            options=options, agree=components.cross_device_ops.agree,
        )

    def experimental_distribute_datasets_from_function(
        self, dataset_fn: Callable[..., Any], options: Any = None
    ) -> Any:
        """TF's older name of :meth:`distribute_datasets_from_function`."""
        return self.distribute_datasets_from_function(dataset_fn, options)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(devices={list(self._extended.worker_devices)})"
