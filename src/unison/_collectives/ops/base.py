"""CrossDeviceOps: the abstract interface of every reduction/broadcast algorithm.

Two families implement it: in-process algorithms over this worker's devices
(``local.py``) and the cross-process CollectiveAllReduce over a torch.distributed
process group (``collective.py``). Strategies only talk to this interface.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

import torch

from unison._collectives.ops.in_place_reduction import InPlaceReduction
from unison._devices import canonicalize_all, torch_device
from unison._reduce import ReduceOp
from unison._values.values import DistributedValues, Mirrored, PerReplica

__all__ = ["CrossDeviceOps", "check_same_layout", "to_destinations", "normalize_destinations"]

Destinations = tuple[str, ...]


def normalize_destinations(destinations: Any) -> Destinations:
    """Device names from a device string, a list of them, or a distributed variable."""
    devices = getattr(destinations, "devices", None)
    if isinstance(destinations, DistributedValues) and devices is not None:
        return tuple(devices)
    return canonicalize_all(destinations, field="destinations")


def check_same_layout(value: PerReplica, what: str = "reduce") -> None:
    """Raises ValueError unless every component is a tensor of one shape and dtype."""
    components = value.values
    if len(components) == 1 and isinstance(components[0], torch.Tensor):
        return
    for i, c in enumerate(components):
        if not isinstance(c, torch.Tensor):
            raise TypeError(
                f"cannot {what} replica {i}'s value of type {type(c).__name__}: every component must be a torch.Tensor"
            )
    first = components[0]
    for i, c in enumerate(components[1:], start=1):
        if c.shape != first.shape or c.dtype != first.dtype:
            raise ValueError(
                f"cannot {what} per-replica tensors of different layouts: replica 0 has shape "
                f"{tuple(first.shape)} and dtype {first.dtype}, replica {i} has shape {tuple(c.shape)} and "
                f"dtype {c.dtype}; every replica must produce the same shape and dtype"
            )


def to_destinations(
    tensor: torch.Tensor, destinations: Destinations, copies: Sequence[torch.Tensor] | None = None
) -> Any:
    """Places a reduced tensor on each destination: a tensor for one device, else Mirrored.

    ``copies`` may give ready-made per-destination tensors (an all-reduce's outputs).
    """
    if len(destinations) == 1:
        if copies is not None:
            return copies[0]
        return tensor.to(torch_device(destinations[0]))  # no copy when it is already there
    if copies is None:
        copies = [tensor.to(torch_device(d), copy=i > 0) for i, d in enumerate(destinations)]
    return Mirrored(copies)


class CrossDeviceOps(abc.ABC):
    """Reduces and broadcasts tensors across replicas (``tf.distribute.CrossDeviceOps``).

    Pass an instance to ``MirroredStrategy(cross_device_ops=...)`` to choose the
    algorithm; prefer the strategy's own methods over calling these directly.
    """

    def reduce(self, reduce_op: ReduceOp | str, per_replica_value: Any, destinations: Any) -> Any:
        """Reduces one PerReplica value onto ``destinations`` (device names or a variable)."""
        return self.batch_reduce(reduce_op, [(per_replica_value, destinations)])[0]

    def batch_reduce(self, reduce_op: ReduceOp | str, value_destination_pairs: Sequence[tuple[Any, Any]]) -> list[Any]:
        """Reduces several PerReplica values at once; returns one result per pair."""
        reduce_op = ReduceOp.from_any(reduce_op)
        pairs = []
        # batches usually name one destination for every value: resolve it once
        named: Any = None
        normalized: Destinations = ()
        for i, (value, destinations) in enumerate(value_destination_pairs):
            if not isinstance(value, PerReplica):
                value = PerReplica(value.values if isinstance(value, DistributedValues) else [value])
            check_same_layout(value)
            if destinations is not named or i == 0:
                named, normalized = destinations, normalize_destinations(destinations)
            pairs.append((value, normalized))
        return self._batch_reduce(reduce_op, pairs) if pairs else []

    def broadcast(self, tensor: torch.Tensor, destinations: Any) -> Any:
        """Copies ``tensor`` to every destination device."""
        return to_destinations(tensor, normalize_destinations(destinations))

    def gather(self, per_replica_value: Any, destinations: Any, axis: int) -> Any:
        """Concatenates the components along ``axis`` onto ``destinations``."""
        if not isinstance(per_replica_value, PerReplica):
            per_replica_value = PerReplica(getattr(per_replica_value, "values", [per_replica_value]))
        return self._gather(per_replica_value, normalize_destinations(destinations), axis)

    def agree(self, local_has_data: bool) -> bool:
        """True only if every worker has data for this step (one worker: the local answer)."""
        return local_has_data

    def in_place_reduction(self, reduce_op: ReduceOp, devices: Sequence[str]) -> InPlaceReduction | None:
        """A reduction of replicas' gradients into the gradients themselves that equals this op's, or None.

        The replicas on ``devices`` (one worker's, in replica order) share its memory; an
        op that can reduce their gradients with nothing moved or allocated returns the
        reduction (``in_place_reduction.py``) that does it with its own arithmetic. None
        (the default): every reduction goes through :meth:`batch_reduce`.
        """
        return None

    @abc.abstractmethod
    def _batch_reduce(self, reduce_op: ReduceOp, pairs: list[tuple[PerReplica, Destinations]]) -> list[Any]:
        """Reduces validated (PerReplica, destination devices) pairs."""

    def _gather(self, value: PerReplica, destinations: Destinations, axis: int) -> Any:
        target = torch_device(destinations[0])
        gathered = torch.cat([c.to(target) for c in value.values], dim=axis)
        return to_destinations(gathered, destinations)
