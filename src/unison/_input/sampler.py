"""A batch sampler that gives one worker its share of every global batch of a map-style Dataset.

``torch.utils.data.DistributedSampler`` pads the epoch with repeated samples (or drops
some) so that every worker gets the same number of samples; here every sample is used
exactly once and every worker still runs the same number of steps: the last global
batch is split as evenly as possible, so a worker's last batch may be smaller or empty.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from torch.utils.data import Sampler

from unison._input._checks import require_int
from unison._input.sharding import epoch_order, num_steps, worker_batches

__all__ = ["ShardedBatchSampler", "EmptySafeCollate"]


class ShardedBatchSampler(Sampler[list[int]]):
    """Yields, per step, the indices worker ``worker_index`` loads from a map-style Dataset.

    The epoch's order (shuffled with ``seed + epoch`` when ``shuffle``, the same on every
    worker) is cut into global batches of ``global_batch_size``; each worker keeps a
    contiguous, as-even-as-possible share of each (see
    :func:`unison._input.sharding.worker_batches`). Use it as a DataLoader's
    ``batch_sampler``; call :meth:`set_epoch` before each epoch to reshuffle.

    Equivalent: what ``tf.data`` auto-sharding by DATA gives a batched dataset; in
    PyTorch, ``DistributedSampler`` + per-worker batching, without padding.

    Args:
        num_samples: length of the dataset.
        global_batch_size: samples per step across all workers.
        num_workers: workers sharing each global batch.
        worker_index: this worker.
        shuffle: shuffle the order each epoch.
        seed: base seed of the shuffle; must be the same on every worker.
        drop_last: drop the last global batch when it is smaller than the others.

    Raises:
        TypeError, ValueError: for counts that are not ints in range.
    """

    def __init__(
        self,
        num_samples: int,
        global_batch_size: int,
        *,
        num_workers: int = 1,
        worker_index: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ):
        self.num_samples = require_int("num_samples", num_samples, minimum=0)
        self.global_batch_size = require_int("global_batch_size", global_batch_size, minimum=1)
        self.num_workers = require_int("num_workers", num_workers, minimum=1)
        self.worker_index = require_int("worker_index", worker_index, minimum=0)
        if worker_index >= num_workers:
            raise ValueError(f"`worker_index` {worker_index!r} is out of range for num_workers={num_workers}")
        self.shuffle = bool(shuffle)
        self.seed = require_int("seed", seed, minimum=-(2**63))
        self.drop_last = bool(drop_last)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Selects the epoch whose order the next pass follows (reshuffles when shuffling)."""
        self.epoch = require_int("epoch", epoch, minimum=0)

    def order(self) -> list[int]:
        """The current epoch's sample order, before sharding (the same on every worker)."""
        return epoch_order(self.num_samples, shuffle=self.shuffle, seed=self.seed, epoch=self.epoch)

    def __iter__(self) -> Iterator[list[int]]:
        return worker_batches(
            self.order(), self.global_batch_size, self.num_workers, self.worker_index, drop_last=self.drop_last
        )

    def __len__(self) -> int:
        return num_steps(self.num_samples, self.global_batch_size, self.drop_last)


class EmptySafeCollate:
    """Wraps a collate function so that an empty share collates to ``None``.

    ``default_collate([])`` fails; the distributed dataset replaces ``None`` by a 0-row
    batch shaped like the others. A module-level class, so it pickles into DataLoader
    worker processes.
    """

    def __init__(self, collate_fn: Callable[[Any], Any]):
        self.collate_fn = collate_fn

    def __call__(self, samples: Sequence[Any]) -> Any:
        if len(samples) == 0:
            return None
        return self.collate_fn(samples)
