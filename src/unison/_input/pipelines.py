"""Input pipelines: from what the user's dataset yields to one host batch per local replica.

Each function here is a generator over steps; a step is a list with one batch per local
replica (still on the host). They check every batch they read (see
:class:`unison._input.structure.BatchChecker`) and apply the arithmetic of
:mod:`unison._input.sharding`. :class:`unison._input.iterator.DistributedIterator` then
agrees on the end with the other workers and moves the batches to the replicas' devices.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from unison._input.sharding import shard_rows, split_slices
from unison._input.structure import BatchChecker, slice_batch

__all__ = ["data_shard_steps", "rebatch_steps", "worker_batch_steps", "per_replica_steps", "check_min_rows"]

Step = list  # one host batch per local replica


def check_min_rows(rows: int, num_workers: int, num_replicas: int, *, what: str) -> None:
    """Rejects a global batch smaller than the number of replicas in sync.

    Raises:
        ValueError: naming the batch size, the replica count and the fix.
    """
    needed = num_workers * num_replicas
    if rows < needed:
        raise ValueError(
            f"{what} is {rows}, smaller than the {needed} replicas in sync ({num_workers} worker(s) x "
            f"{num_replicas} local replica(s)): every replica needs at least one row; use a global "
            f"batch size of at least {needed} (ideally a multiple of {needed})"
        )


def data_shard_steps(
    dataset: Iterable[Any], *, num_workers: int, worker_index: int, num_replicas: int
) -> Iterator[Step]:
    """DATA sharding: every worker reads every global batch and keeps its rows of it.

    One global batch is one step on every worker, so all workers run the same number of
    steps without talking to each other. The first global batch must have at least one
    row per replica in sync; later (last) batches are split as evenly as possible.
    """
    checker = BatchChecker("global batch")
    for step, batch in enumerate(dataset):
        rows = checker.check(batch, step)
        if step == 0:
            check_min_rows(rows, num_workers, num_replicas, what="the first global batch size")
        yield [slice_batch(batch, s) for s in shard_rows(rows, num_workers, worker_index, num_replicas)]


def rebatch_steps(dataset: Iterable[Any], *, num_workers: int, num_replicas: int) -> Iterator[Step]:
    """FILE / OFF: each global-size batch this worker reads becomes ``num_workers`` steps.

    Step ``j`` of a batch takes the rows worker ``j`` would keep under DATA sharding, so
    the per-replica batch size is the same as with DATA, whatever the policy.
    """
    checker = BatchChecker("global batch")
    for index, batch in enumerate(dataset):
        rows = checker.check(batch, index)
        if index == 0:
            check_min_rows(rows, num_workers, num_replicas, what="the first global batch size")
        for part in range(num_workers):
            yield [slice_batch(batch, s) for s in shard_rows(rows, num_workers, part, num_replicas)]


def worker_batch_steps(
    loader: Iterable[Any], *, num_replicas: int, make_empty: Callable[[], Any]
) -> Iterator[Step]:
    """Map-style path: ``loader`` yields this worker's batch per step (``None`` = no rows).

    Args:
        loader: a DataLoader over a :class:`~unison._input.sampler.ShardedBatchSampler`.
        num_replicas: local replicas to split each batch across.
        make_empty: builds a 0-row batch when the worker's very first share is empty.
    """
    checker = BatchChecker("worker batch")
    for step, batch in enumerate(loader):
        if batch is None:
            batch = checker.empty_like() if checker.seen else make_empty()
        rows = checker.check(batch, step)
        yield [slice_batch(batch, s) for s in split_slices(rows, num_replicas)]


def per_replica_steps(iterables: Sequence[Iterable[Any]], *, num_replicas: int) -> Iterator[Step]:
    """``distribute_datasets_from_function``: pipelines already batched per replica.

    With one pipeline (PER_WORKER), each step deals its next ``num_replicas`` batches to
    the replicas in order; with ``num_replicas`` pipelines (PER_REPLICA), replica ``r``
    takes the next batch of pipeline ``r``. A step exists while any pipeline has data;
    replicas left without a batch get a 0-row batch shaped like the others.
    """
    per_worker = len(iterables) == 1
    checker = BatchChecker("per-replica batch")
    iterators: list[Iterator[Any] | None] = [iter(it) for it in iterables]
    step = 0
    while True:
        batches = [_next_or_none(iterators, 0 if per_worker else r) for r in range(num_replicas)]
        if all(b is None for b in batches):
            return
        for replica, batch in enumerate(batches):
            if batch is not None:
                checker.check(batch, step, "" if per_worker else f" of local input pipeline {replica}")
        step += 1
        yield [checker.empty_like() if b is None else b for b in batches]


def _next_or_none(iterators: list[Iterator[Any] | None], index: int) -> Any:
    iterator = iterators[index]
    if iterator is None:
        return None
    try:
        return next(iterator)
    except StopIteration:
        iterators[index] = None
        return None
