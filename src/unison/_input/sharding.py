"""Pure sharding arithmetic: which rows, samples and files a worker and a replica get.

Every function here is pure (no tensors, no I/O), so that the property "every sample
is used exactly once per epoch, and every worker runs the same number of steps" can be
checked exhaustively. The input pipelines in :mod:`unison._input.pipelines` apply them.

Splits are contiguous and as even as possible: the first parts get one extra row, a
part may be empty. A global batch of ``n`` rows goes first to the ``W`` workers, then
each worker's rows go to its ``R`` local replicas, so concatenating the replicas' rows
in global replica order (``worker * R + replica``) gives back the global batch.

File protocol (``AutoShardPolicy.FILE``): a dataset exposes files when it has a
``files`` attribute (a sequence of paths) and a ``with_files(files)`` method returning a
new iterable of batches that reads only those files. Worker ``w`` of ``W`` gets files
``w, w + W, w + 2W, ...``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from unison._input._checks import require_int

__all__ = [
    "split_sizes",
    "split_slices",
    "worker_slice",
    "shard_rows",
    "num_steps",
    "epoch_order",
    "worker_batches",
    "exposes_files",
    "shard_files",
]


def split_sizes(total: int, parts: int) -> tuple[int, ...]:
    """Splits ``total`` rows into ``parts`` sizes that differ by at most one.

    The first ``total % parts`` parts get the extra row; parts may be 0.

    Example:
        >>> split_sizes(5, 3)
        (2, 2, 1)
    """
    require_int("total", total, minimum=0)
    require_int("parts", parts, minimum=1)
    base, extra = divmod(total, parts)
    return tuple(base + (i < extra) for i in range(parts))


def split_slices(total: int, parts: int, *, start: int = 0) -> tuple[slice, ...]:
    """Contiguous slices of ``split_sizes(total, parts)``, beginning at row ``start``."""
    slices = []
    for size in split_sizes(total, parts):
        slices.append(slice(start, start + size))
        start += size
    return tuple(slices)


def worker_slice(total: int, num_workers: int, worker_index: int) -> slice:
    """The rows of a ``total``-row global batch that worker ``worker_index`` keeps.

    Raises:
        ValueError: if ``worker_index`` is not in ``range(num_workers)``.
    """
    _check_index("worker_index", worker_index, num_workers, "num_workers")
    return split_slices(total, num_workers)[worker_index]


def shard_rows(total: int, num_workers: int, worker_index: int, num_replicas: int) -> tuple[slice, ...]:
    """The rows of a global batch for each local replica of worker ``worker_index``.

    Args:
        total: rows in the global batch.
        num_workers: workers sharing the batch.
        worker_index: this worker.
        num_replicas: local replicas of this worker.

    Returns:
        ``num_replicas`` slices into the global batch, in replica order.

    Example:
        >>> shard_rows(6, 2, 1, 2)
        (slice(3, 5, None), slice(5, 6, None))
    """
    rows = worker_slice(total, num_workers, worker_index)
    return split_slices(rows.stop - rows.start, num_replicas, start=rows.start)


def num_steps(num_samples: int, global_batch_size: int, drop_last: bool) -> int:
    """Steps in one epoch of ``num_samples`` samples in global batches of ``global_batch_size``.

    The last, smaller batch counts as a step unless ``drop_last``.
    """
    require_int("num_samples", num_samples, minimum=0)
    require_int("global_batch_size", global_batch_size, minimum=1)
    full, rest = divmod(num_samples, global_batch_size)
    return full + (1 if rest and not drop_last else 0)


def epoch_order(num_samples: int, *, shuffle: bool, seed: int, epoch: int) -> list[int]:
    """The order in which an epoch visits samples: the same on every worker.

    A shuffled order is ``torch.randperm`` seeded with ``seed + epoch`` (the rule of
    ``torch.utils.data.DistributedSampler``), so it is reproducible and changes per epoch.
    """
    require_int("num_samples", num_samples, minimum=0)
    if not shuffle:
        return list(range(num_samples))
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    return torch.randperm(num_samples, generator=generator).tolist()


def worker_batches(
    order: Sequence[int],
    global_batch_size: int,
    num_workers: int,
    worker_index: int,
    *,
    drop_last: bool,
) -> Iterator[list[int]]:
    """Yields, per step, the sample indices worker ``worker_index`` loads.

    ``order`` is cut into global batches of ``global_batch_size``; the worker keeps its
    :func:`worker_slice` of each. Every worker yields the same number of lists (one
    per step); in the last step a list may be shorter or empty.
    """
    _check_index("worker_index", worker_index, num_workers, "num_workers")
    for step in range(num_steps(len(order), global_batch_size, drop_last)):
        batch = order[step * global_batch_size : (step + 1) * global_batch_size]
        yield list(batch[worker_slice(len(batch), num_workers, worker_index)])


def exposes_files(dataset: Any) -> bool:
    """Whether ``dataset`` follows the file protocol (``files`` and ``with_files``)."""
    return hasattr(dataset, "files") and callable(getattr(dataset, "with_files", None))


def shard_files(files: Sequence[Any], num_workers: int, worker_index: int) -> list[Any]:
    """The files worker ``worker_index`` reads: ``files[worker_index::num_workers]``.

    Raises:
        TypeError: if ``files`` is a single string rather than a sequence of paths.
        ValueError: if there are fewer files than workers.
    """
    _check_index("worker_index", worker_index, num_workers, "num_workers")
    if isinstance(files, (str, bytes, os.PathLike)):
        raise TypeError(f"`files` must be a sequence of paths, got a single path {files!r}")
    files = list(files)
    if len(files) < num_workers:
        raise ValueError(
            f"FILE sharding needs at least one file per worker, got {len(files)} files for "
            f"{num_workers} workers: use AutoShardPolicy.DATA (or AUTO), or split the data into "
            f"at least {num_workers} files"
        )
    return files[worker_index::num_workers]


def _check_index(field: str, index: int, count: int, count_field: str) -> None:
    require_int(count_field, count, minimum=1)
    require_int(field, index, minimum=0)
    if index >= count:
        raise ValueError(f"`{field}` {index!r} is out of range for {count_field}={count} (valid 0..{count - 1})")
