"""The iterator over a distributed dataset, and the Optional it returns at the end.

Workers must stop at the same step: a worker that leaves the loop while the others run
one more step leaves their collectives waiting. When workers may see different numbers
of batches, every step asks the strategy's ``agree`` callable whether *all* workers have
data, and all stop together the first time one of them has none.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, TypeVar, cast

from torch.utils import _pytree as pytree

from unison._input.context import InputOptions
from unison._input.structure import place_batch
from unison._values.values import PerReplica

__all__ = ["DistributedIterator", "OptionalValue", "Agree"]

T = TypeVar("T")

Agree = Callable[[bool], bool]
"""``agree(local_has_data) -> bool``: True only if every worker has data for this step."""


class OptionalValue(Generic[T]):
    """A value that may be absent: what :meth:`DistributedIterator.get_next_as_optional` returns.

    Equivalent: ``tf.experimental.Optional`` (``has_value``, ``get_value``, ``empty``,
    ``from_value``); ``has_value()`` is a Python bool here, not a tensor.
    """

    __slots__ = ("_has_value", "_value")

    def __init__(self, has_value: bool, value: Any = None):
        self._has_value = has_value
        self._value = value

    @classmethod
    def from_value(cls, value: T) -> OptionalValue[T]:
        """An Optional holding ``value``."""
        return cls(True, value)

    @classmethod
    def empty(cls) -> OptionalValue[Any]:
        """An Optional holding nothing."""
        return cls(False)

    def has_value(self) -> bool:
        """Whether a value is present."""
        return self._has_value

    def get_value(self) -> T:
        """The value.

        Raises:
            ValueError: if the Optional is empty (check :meth:`has_value` first).
        """
        if not self._has_value:
            raise ValueError("this OptionalValue is empty: check has_value() before get_value()")
        return self._value

    def __repr__(self) -> str:
        return f"OptionalValue({self._value!r})" if self._has_value else "OptionalValue(<empty>)"


class DistributedIterator:
    """Iterates a distributed dataset: one batch per local replica per step.

    With one local replica a step is that replica's batch itself (a plain structure);
    with several, a structure of the same shape whose tensor leaves are ``PerReplica``
    values. Components are on the replicas' devices unless
    ``options.experimental_fetch_to_device`` is False.

    Equivalent: ``tf.distribute.DistributedIterator`` (``__next__``,
    ``get_next_as_optional``). Created by iterating a ``DistributedDataset`` or
    ``DistributedDatasetsFromFunction``, not directly.

    Args:
        steps: host batches, one list of per-replica batches per step.
        devices: the canonical device of each local replica.
        options: how to deliver components (fetch to device, pin memory).
        agree: called once per step with whether this worker has data; returns True
            only when every worker has. None when the workers are known to agree.
        worker_index: this worker, for messages.
    """

    def __init__(
        self,
        steps: Iterator[Sequence[Any]],
        *,
        devices: Sequence[str],
        options: InputOptions,
        agree: Agree | None = None,
        worker_index: int = 0,
    ):
        self._steps = steps
        self._devices = tuple(devices)
        self._options = options
        self._agree = agree
        self._worker_index = worker_index
        self._step = 0
        self._done = False

    def __iter__(self) -> DistributedIterator:
        return self

    def __next__(self) -> Any:
        optional = self._get_next(stacklevel=3)
        if not optional.has_value():
            raise StopIteration
        return optional.get_value()

    def get_next_as_optional(self) -> OptionalValue[Any]:
        """The next step's batch, or an empty Optional at the end (the same step on all workers).

        Returns:
            ``OptionalValue`` holding the step's batch, or an empty one once the input is
            exhausted; it stays empty afterwards.
        """
        return self._get_next(stacklevel=3)

    def _get_next(self, stacklevel: int) -> OptionalValue[Any]:
        if self._done:
            return OptionalValue.empty()
        step = next(self._steps, None)
        has_data = step is not None
        if self._agree is not None:
            everyone = bool(self._agree(has_data))
            if has_data and not everyone:
                warnings.warn(
                    f"worker {self._worker_index} stops at step {self._step} with input left, "
                    f"because another worker ran out: give every worker the same number of batches "
                    f"(e.g. files of equal size) to use all data",
                    UserWarning,
                    stacklevel=stacklevel,
                )
            has_data = everyone
        if not has_data:
            self._done = True
            close = getattr(self._steps, "close", None)
            if close is not None:
                close()
            return OptionalValue.empty()
        self._step += 1
        return OptionalValue.from_value(self._deliver(cast(Sequence[Any], step)))

    def _deliver(self, replicas: Sequence[Any]) -> Any:
        if self._options.experimental_fetch_to_device:
            pin = self._options.pin_memory
            replicas = [place_batch(b, d, pin_memory=pin) for b, d in zip(replicas, self._devices)]
        if len(replicas) == 1:
            return replicas[0]
        # Not values.regroup: it keeps a leaf that is the same object on every replica
        # whole, but input components are per replica even when a pipeline repeats one.
        flats = [pytree.tree_flatten(batch) for batch in replicas]
        leaves = [PerReplica(components) for components in zip(*(leaves for leaves, _ in flats))]
        return pytree.tree_unflatten(leaves, flats[0][1])
