"""In-process CrossDeviceOps: reduce across the devices of one worker.

All of them are built from the K x N gradient-list helpers of
``transport/in_process.py`` and the shared ``TensorPacker``: a batch of PerReplica
values becomes K device lists of N tensors, is packed into K x P buffers, reduced, and
unpacked again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from unison._collectives.ops.base import CrossDeviceOps, Destinations, to_destinations
from unison._collectives.ops.in_place_reduction import InPlaceReduction
from unison._collectives.transport.in_process import aggregate_grads, allreduce_grads, allreduce_grads_hierarchical
from unison._collectives.transport.packing import TensorPacker
from unison._devices import canonicalize, canonicalize_all, is_cuda, torch_device
from unison._interpose.torch_private import has_nccl_all_reduce
from unison._reduce import ReduceOp
from unison._values.values import Mirrored, PerReplica

__all__ = [
    "ReductionToOneDevice",
    "AllReduceCrossDeviceOps",
    "NcclAllReduce",
    "HierarchicalCopyAllReduce",
    "select_cross_device_ops",
]


def _device_lists(values: Sequence[PerReplica]) -> list[list[torch.Tensor]]:
    """Regroups N PerReplica values of K components into K lists of N tensors."""
    return [list(components) for components in zip(*(v.values for v in values))]


class ReductionToOneDevice(CrossDeviceOps):
    """Copies every component to one device, reduces there, and broadcasts back.

    Simple and always applicable (any devices, sparse tensors, differing
    destinations); no packing. ``tf.distribute.ReductionToOneDevice``.

    Args:
        reduce_to_device: where to reduce; default the first destination device.
        accumulation_fn: ``fn(list_of_tensors) -> tensor`` that adds them; default a sum.
    """

    def __init__(self, reduce_to_device: str | None = None,
                 accumulation_fn: Callable[[list[torch.Tensor]], torch.Tensor] | None = None):
        self.reduce_to_device = canonicalize(reduce_to_device) if reduce_to_device is not None else None
        self.accumulation_fn = accumulation_fn

    def in_place_reduction(self, reduce_op: ReduceOp, devices: Sequence[str]) -> InPlaceReduction | None:
        """CPU replicas with the default sum, reduced where they are: replica 0's gradient becomes the
        sum in replica order (this op's additions), divided for MEAN, copied into the others'.

        None for a sum of the user's (``accumulation_fn``), a device other than the
        replicas', GPUs, or a subclass with a reduction of its own.
        """
        if (self.accumulation_fn is not None or type(self)._batch_reduce is not ReductionToOneDevice._batch_reduce
                or self.reduce_to_device not in (None, *devices) or any(is_cuda(d) for d in devices)):
            return None
        return InPlaceReduction(len(devices), reduce_op is ReduceOp.MEAN)

    def _batch_reduce(self, reduce_op: ReduceOp, pairs: list[tuple[PerReplica, Destinations]]) -> list[Any]:
        results: list[Any] = [None] * len(pairs)
        rest = self._packed_batches(reduce_op, pairs, results) if self.accumulation_fn is None else range(len(pairs))
        for i in rest:
            value, destinations = pairs[i]
            device = self.reduce_to_device or destinations[0]
            count = len(value.values)
            if self.accumulation_fn is not None:
                total = self.accumulation_fn([c.to(torch_device(device)) for c in value.values])
            else:
                total = aggregate_grads(
                    [[(c, None)] for c in value.values], devices=[device], average=False
                )[0][0]
                if count == 1:
                    total = total.to(torch_device(device), copy=True)
            if reduce_op is ReduceOp.MEAN:
                total = total / count
            results[i] = to_destinations(total, destinations)
        return results

    def _packed_batches(self, reduce_op: ReduceOp, pairs: list[tuple[PerReplica, Destinations]],
                        results: list[Any]) -> list[int]:
        """Reduces dense values that share destinations and a dtype in one packed sum per group.

        A batch of N gradients of K replicas becomes K flat buffers, added in replica order
        (the same additions, element by element, as one value at a time) and copied once
        per extra destination: K + D copies instead of N x (K + D) small ones. Fills
        ``results``; returns the indices left for the per-value path.
        """
        groups: dict[tuple, list[int]] = {}
        rest = []
        for i, (value, destinations) in enumerate(pairs):
            components = value.values
            if len(components) > 1 and all(c.layout == torch.strided for c in components):
                key = (destinations, self.reduce_to_device or destinations[0], len(components), components[0].dtype)
                if all(c.dtype == key[3] for c in components):
                    groups.setdefault(key, []).append(i)
                    continue
            rest.append(i)
        for (destinations, device, count, _), members in groups.items():
            if len(members) == 1:
                rest.extend(members)
                continue
            place = torch_device(device)
            shapes = [pairs[i][0].values[0].shape for i in members]
            flats = [torch.cat([pairs[i][0].values[k].reshape(-1).to(place) for i in members]) for k in range(count)]
            total = flats[0]
            for flat in flats[1:]:
                total.add_(flat)
            if reduce_op is ReduceOp.MEAN:
                total = total / count
            sizes = [shape.numel() for shape in shapes]
            copies = [total.to(torch_device(d), copy=j > 0) for j, d in enumerate(destinations)]
            pieces = [copy.split(sizes) for copy in copies]
            for n, (i, shape) in enumerate(zip(members, shapes)):
                per_destination = [piece[n].view(shape) for piece in pieces]
                results[i] = per_destination[0] if len(destinations) == 1 else Mirrored(per_destination)
        return sorted(rest)


class AllReduceCrossDeviceOps(CrossDeviceOps):
    """All-reduce with packing, for values whose destinations are their own devices.

    Reductions to other destinations fall back to :class:`ReductionToOneDevice`, as do
    sparse tensors. ``tf.distribute.AllReduceCrossDeviceOps``.

    Args:
        all_reduce_alg: ``"nccl"`` or ``"hierarchical_copy"``.
        num_packs: number of packs per dtype to split the values into; 0 disables packing.
    """

    _ALGORITHMS = ("nccl", "hierarchical_copy")

    def __init__(self, all_reduce_alg: str = "nccl", num_packs: int = 1):
        if all_reduce_alg not in self._ALGORITHMS:
            raise ValueError(f"all_reduce_alg {all_reduce_alg!r} is not supported: use one of {self._ALGORITHMS}")
        if isinstance(num_packs, bool) or not isinstance(num_packs, int) or num_packs < 0:
            raise ValueError(
                f"{type(self).__name__} requires num_packs >= 0, got num_packs={num_packs!r}; "
                f"use 0 for no packing or a positive number of packs"
            )
        self._all_reduce_alg = all_reduce_alg
        self._num_packs = num_packs
        self._fallback = ReductionToOneDevice()

    def _batch_reduce(self, reduce_op: ReduceOp, pairs: list[tuple[PerReplica, Destinations]]) -> list[Any]:
        results: list[Any] = [None] * len(pairs)
        # Integer MEAN goes to the fallback too: it divides out of place (a float mean, as
        # TF's truediv), where the packed all-reduce would divide an integer buffer in place.
        dense = [
            i for i, (v, d) in enumerate(pairs)
            if len(d) == len(v.values) and d == pairs[0][1] and all(c.layout == torch.strided for c in v.values)
            and (reduce_op is ReduceOp.SUM or all(c.is_floating_point() or c.is_complex() for c in v.values))
        ]
        dense = dense if dense and len(pairs[dense[0]][1]) > 1 else []
        for i, pair in enumerate(pairs):
            if i not in dense:
                results[i] = self._fallback._batch_reduce(reduce_op, [pair])[0]
        if dense:
            destinations = pairs[dense[0]][1]
            reduced = self._all_reduce([pairs[i][0] for i in dense], destinations, reduce_op is ReduceOp.MEAN)
            for i, copies in zip(dense, reduced):
                results[i] = to_destinations(copies[0], destinations, copies)
        return results

    def _all_reduce(self, values: list[PerReplica], devices: Destinations, average: bool) -> list[list[torch.Tensor]]:
        """All-reduces N values over K devices; returns N lists of K reduced copies."""
        packer = TensorPacker(num_packs=self._num_packs)
        packs = packer.pack(_device_lists(values))
        if self._all_reduce_alg == "nccl":
            reduced = allreduce_grads(packs, average=average, mode="nccl")
        else:
            reduced = _hierarchical_copy(packs, devices, average)
        per_device = packer.unpack(reduced)
        return [[per_device[k][n] for k in range(len(devices))] for n in range(len(values))]


def _hierarchical_copy(
    packs: list[list[torch.Tensor]], devices: Destinations, average: bool
) -> list[list[torch.Tensor]]:
    """Hierarchical copy all-reduce: two groups reduce to their leaders, leaders exchange.

    With 8 devices it is tensorpack's two-groups-of-4 algorithm; other counts use two
    halves (TensorFlow's generalisation of the DGX-1 tree).
    """
    if len(devices) == 8:
        return allreduce_grads_hierarchical(packs, devices, average=average)
    half = (len(devices) + 1) // 2
    groups = [list(range(half)), list(range(half, len(devices)))]
    num_packs = len(packs[0])
    out: list[list[torch.Tensor]] = [[None] * num_packs for _ in devices]  # type: ignore[list-item]
    for n in range(num_packs):
        partials = []
        for group in groups:
            leader = torch_device(devices[group[0]])
            partial = packs[group[0]][n].to(leader, copy=True)
            for k in group[1:]:
                partial.add_(packs[k][n].to(leader))
            partials.append(partial)
        totals = [partials[0].add_(partials[1].to(partials[0].device))]
        totals.append(totals[0].to(torch_device(devices[groups[1][0]]), copy=True))
        if average:
            for total in totals:
                total.div_(len(devices))
        for total, group in zip(totals, groups):
            for k in group:
                out[k][n] = total if k == group[0] else total.to(torch_device(devices[k]), copy=True)
    return out


class NcclAllReduce(AllReduceCrossDeviceOps):
    """NCCL all-reduce across this process's CUDA devices (``tf.distribute.NcclAllReduce``).

    Raises:
        ValueError: if ``num_packs`` is negative, or (when used) a device is not CUDA.
    """

    def __init__(self, num_packs: int = 1):
        super().__init__(all_reduce_alg="nccl", num_packs=num_packs)

    def check_devices(self, devices: Sequence[str]) -> None:
        non_cuda = [d for d in devices if not is_cuda(d)]
        if non_cuda or not torch.cuda.is_available():
            raise ValueError(
                f"NcclAllReduce needs CUDA devices with NCCL, but got {list(devices)!r} "
                f"(not CUDA: {non_cuda!r}); use cross_device_ops=ReductionToOneDevice() or "
                f"HierarchicalCopyAllReduce(), or leave it unset to choose automatically"
            )

    def _batch_reduce(self, reduce_op: ReduceOp, pairs: list[tuple[PerReplica, Destinations]]) -> list[Any]:
        for _, destinations in pairs:
            self.check_devices(destinations)
        return super()._batch_reduce(reduce_op, pairs)


class HierarchicalCopyAllReduce(AllReduceCrossDeviceOps):
    """Hierarchical copy all-reduce (``tf.distribute.HierarchicalCopyAllReduce``).

    Reduces along a two-level tree made for DGX-1-like machines. Unlike TensorFlow it
    also runs on CPU (logical) devices, where it is exact and useful for tests.
    """

    def __init__(self, num_packs: int = 1):
        super().__init__(all_reduce_alg="hierarchical_copy", num_packs=num_packs)


def select_cross_device_ops(devices: Sequence[str]) -> CrossDeviceOps:
    """Chooses the in-process CrossDeviceOps for ``devices`` as TensorFlow does.

    Any non-CUDA device (or no NCCL) gives ReductionToOneDevice; several CUDA devices
    with NCCL give ``NcclAllReduce(num_packs=1)``.
    """
    names = canonicalize_all(devices)
    if any(not is_cuda(d) for d in names):
        return ReductionToOneDevice()
    nccl = getattr(torch.cuda, "nccl", None)
    if len(names) > 1 and nccl is not None and has_nccl_all_reduce():
        return NcclAllReduce(num_packs=1)
    return ReductionToOneDevice()
