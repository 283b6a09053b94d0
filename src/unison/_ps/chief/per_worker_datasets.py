"""Per-worker datasets: built on each worker by a function the coordinator sends.

tf.distribute equivalent: ``ClusterCoordinator.create_per_worker_dataset`` and its
``PerWorkerDatasetFromDatasetFunction``.
"""

from __future__ import annotations

import itertools
import typing
from typing import Any

from unison._ps.chief.remote_values import PerWorkerValues
from unison._ps.wire.worker_references import WorkerReference, reference

__all__ = ["PerWorkerDataset", "PerWorkerIterator"]

_ITERATOR_IDS = itertools.count()


class _IteratorRef:
    def __init__(self, dataset_id: int, iterator_id: int):
        self.dataset_id, self.iterator_id = dataset_id, iterator_id

    def __reduce__(self) -> tuple:
        return reference(WorkerReference.ITERATOR, (self.dataset_id, self.iterator_id))


@typing.final
class PerWorkerIterator:
    """The iterators of a per-worker dataset, one per worker (pass it to ``schedule``).

    On a worker it is that worker's iterator (it travels as its ``PerWorkerValues``); on
    the coordinator ``next()`` is an error.
    """

    def __init__(self, values: list[Any]):
        self._per_worker = PerWorkerValues(values)

    @property
    def values(self) -> tuple[Any, ...]:
        """The iterators' references, by worker index."""
        return self._per_worker.values

    def __reduce__(self) -> tuple:
        return self._per_worker.__reduce__()

    def __iter__(self) -> PerWorkerIterator:
        return self

    def __next__(self) -> Any:
        raise TypeError("next() of a per-worker iterator only works inside a function scheduled with "
                        "ClusterCoordinator.schedule; pass the iterator in `args`")


class PerWorkerDataset:
    """A dataset made on every worker by ``dataset_fn``; ``iter()`` gives per-worker iterators.

    Pass the iterator in ``args`` of ``ClusterCoordinator.schedule``; inside the
    function, ``next(iterator)`` reads the iterator of the worker it runs on. A worker
    that comes back after a failure rebuilds its dataset (and starts its iterators
    afresh), as TensorFlow does.
    """

    def __init__(self, dataset_id: int, num_workers: int):
        self._dataset_id = dataset_id
        self._num_workers = num_workers

    def __iter__(self) -> PerWorkerIterator:
        iterator_id = next(_ITERATOR_IDS)
        return PerWorkerIterator([_IteratorRef(self._dataset_id, iterator_id)] * self._num_workers)

    def __repr__(self) -> str:
        return f"PerWorkerDataset(id={self._dataset_id}, workers={self._num_workers})"
