"""Pieces shared by the two distributed dataset kinds (private)."""

from __future__ import annotations

import collections.abc
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader, Dataset, IterableDataset

from unison._devices import canonicalize_all
from unison._input._checks import require_int
from unison._input.context import InputOptions
from unison._input.iterator import Agree, DistributedIterator

__all__ = ["Placement", "OnePass", "forward_set_epoch", "is_map_style", "sized_len"]


class Placement:
    """The checked common arguments: where this worker sits and how to deliver."""

    def __init__(self, num_workers: int, worker_index: int, devices: Any, options: Any, agree: Any):
        self.num_workers = require_int("num_workers", num_workers, minimum=1)
        self.worker_index = require_int("worker_index", worker_index, minimum=0)
        if worker_index >= num_workers:
            raise ValueError(
                f"`worker_index` {worker_index!r} is out of range: there are {num_workers} workers "
                f"(valid 0..{num_workers - 1})"
            )
        self.devices = canonicalize_all(devices, field="devices")
        if options is None:
            options = InputOptions()
        if not isinstance(options, InputOptions):
            raise TypeError(f"`options` must be an InputOptions or None, got {type(options).__name__}: {options!r}")
        self.options = options
        if agree is not None and not callable(agree):
            raise TypeError(f"`agree` must be a callable agree(local_has_data) -> bool or None, got {agree!r}")
        # One worker always agrees with itself: skip the per-step call.
        self.agree: Agree | None = agree if num_workers > 1 else None

    @property
    def num_replicas(self) -> int:
        return len(self.devices)

    def iterator(self, steps: Iterator[Any], *, needs_agree: bool) -> DistributedIterator:
        return DistributedIterator(
            steps,
            devices=self.devices,
            options=self.options,
            agree=self.agree if needs_agree else None,
            worker_index=self.worker_index,
        )


def is_map_style(dataset: Any) -> bool:
    return isinstance(dataset, Dataset) and not isinstance(dataset, IterableDataset)


def sized_len(dataset: Any) -> int | None:
    try:
        return len(dataset)
    except TypeError:
        return None


def forward_set_epoch(source: Any, epoch: int) -> None:
    targets = [source]
    if isinstance(source, DataLoader):
        batch_sampler = source.batch_sampler
        targets += [source.sampler, batch_sampler, getattr(batch_sampler, "sampler", None), source.dataset]
    called: set[int] = set()
    for target in targets:
        method = getattr(target, "set_epoch", None)
        if callable(method) and id(target) not in called:
            called.add(id(target))
            method(epoch)


class OnePass:
    """Refuses a second pass over a one-shot iterator instead of yielding an empty epoch."""

    def __init__(self, source: Any, what: str):
        self._one_shot = isinstance(source, collections.abc.Iterator)
        self._what = what
        self._passes = 0

    def start(self) -> None:
        if self._one_shot and self._passes:
            raise ValueError(
                f"{self._what} is a one-shot iterator (e.g. a generator) that the previous pass consumed: "
                f"pass a re-iterable object (a DataLoader, a list, an object with __iter__) to iterate "
                f"more than once"
            )
        self._passes += 1
