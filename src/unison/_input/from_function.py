"""The distributed datasets of ``distribute_datasets_from_function``.

The user's function builds each input pipeline itself from an
:class:`~unison._input.context.InputContext` (shard, batch per replica); this module
calls it once per pipeline and deals the per-replica batches to the local replicas.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from unison._input._checks import require_int
from unison._input._common import OnePass, Placement, forward_set_epoch, is_map_style
from unison._input.context import InputContext, InputOptions, InputReplicationMode
from unison._input.iterator import DistributedIterator
from unison._input.pipelines import per_replica_steps

__all__ = ["DistributedDatasetsFromFunction"]


class DistributedDatasetsFromFunction:
    """Datasets made by a user function, once per input pipeline, batched per replica.

    ``dataset_fn(input_context)`` is called at construction, once per input pipeline of
    this worker: one pipeline per worker (``PER_WORKER``, the default), whose batches
    are dealt to the local replicas in turn, or one per local replica
    (``PER_REPLICA``). It must return a re-iterable of *per-replica* batches (e.g. a
    DataLoader batched with ``input_context.get_per_replica_batch_size(global)``) and
    shard its data itself using ``input_context``. A step exists while any local
    pipeline has data (a replica left without a batch gets a 0-row one shaped like the
    others); across workers, ``agree`` ends the loop at the same step everywhere.
    ``options.auto_shard_policy`` does not apply: the function shards.

    Equivalent: the result of ``tf.distribute.Strategy.distribute_datasets_from_function``.
    As there, it is an instance of :class:`~unison._input.dataset.DistributedDataset`
    (a registered virtual subclass: it shares iteration, ``set_epoch`` and ``options``).

    Args:
        dataset_fn: ``dataset_fn(InputContext) -> iterable of per-replica batches``.
        devices: canonical names of this worker's replica devices.
        num_workers: workers in the cluster.
        worker_index: this worker.
        num_replicas_in_sync: replicas in one step across the cluster; defaults to
            ``num_workers * len(devices)``.
        options: delivery options; ``experimental_replication_mode`` picks the pipelines.
        agree: ``agree(local_has_data) -> bool`` so all workers stop at the same step;
            used when ``num_workers > 1``.

    Raises:
        TypeError: if ``dataset_fn`` is not callable or returns something that is not an
            iterable of batches (e.g. a map-style Dataset of samples).
    """

    def __init__(
        self,
        dataset_fn: Callable[[InputContext], Iterable[Any]],
        *,
        devices: Sequence[str | torch.device],
        num_workers: int = 1,
        worker_index: int = 0,
        num_replicas_in_sync: int | None = None,
        options: InputOptions | None = None,
        agree: Callable[[bool], bool] | None = None,
    ):
        self._placement = p = Placement(num_workers, worker_index, devices, options, agree)
        if not callable(dataset_fn):
            raise TypeError(f"`dataset_fn` must be callable, got {type(dataset_fn).__name__}: {dataset_fn!r}")
        W, w, R = p.num_workers, p.worker_index, p.num_replicas
        in_sync = W * R if num_replicas_in_sync is None else num_replicas_in_sync
        require_int("num_replicas_in_sync", in_sync, minimum=1)
        if p.options.experimental_replication_mode is InputReplicationMode.PER_WORKER:
            contexts = [InputContext(W, w, in_sync)]
        else:
            contexts = [InputContext(W * R, w * R + r, in_sync) for r in range(R)]
        self._contexts = tuple(contexts)
        self._datasets = tuple(self._call(dataset_fn, ctx) for ctx in contexts)
        self._passes = [
            OnePass(d, f"the dataset dataset_fn returned for {c}") for d, c in zip(self._datasets, contexts)
        ]

    @property
    def options(self) -> InputOptions:
        """The input options this dataset delivers with."""
        return self._placement.options

    @property
    def input_contexts(self) -> tuple[InputContext, ...]:
        """The InputContext of each of this worker's input pipelines."""
        return self._contexts

    @property
    def datasets(self) -> tuple[Iterable[Any], ...]:
        """What ``dataset_fn`` returned for each of this worker's input pipelines."""
        return self._datasets

    def set_epoch(self, epoch: int) -> None:
        """Forwards ``set_epoch`` to each pipeline's dataset (or its DataLoader sampler) that has one."""
        require_int("epoch", epoch, minimum=0)
        for dataset in self._datasets:
            forward_set_epoch(dataset, epoch)

    def __iter__(self) -> DistributedIterator:
        for one_pass in self._passes:
            one_pass.start()
        steps = per_replica_steps(self._datasets, num_replicas=self._placement.num_replicas)
        return self._placement.iterator(steps, needs_agree=True)

    @staticmethod
    def _call(dataset_fn: Callable[[InputContext], Any], ctx: InputContext) -> Iterable[Any]:
        dataset = dataset_fn(ctx)
        if is_map_style(dataset):
            raise TypeError(
                f"dataset_fn returned a map-style {type(dataset).__name__} for {ctx}, which yields samples: "
                f"return a DataLoader batched with ctx.get_per_replica_batch_size(global_batch_size)"
            )
        if isinstance(dataset, (torch.Tensor, str, bytes, Mapping)) or not isinstance(dataset, Iterable):
            raise TypeError(
                f"dataset_fn returned {type(dataset).__name__} for {ctx}: return an iterable of per-replica "
                f"batches (a DataLoader, a list, ...)"
            )
        return dataset
