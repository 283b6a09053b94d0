"""tensorpack's gradient-list helpers that no unison strategy is built from, kept for its users.

tensorpack (``graph_builder/utils.py``) works on K lists (one per device) of N
gradients or (gradient, variable) pairs. The helpers unison's CrossDeviceOps are built
from (``allreduce_grads``, ``allreduce_grads_hierarchical``, ``aggregate_grads``,
``TensorPacker``) live in ``transport/in_process.py`` and ``transport/packing.py``;
least-loaded placement (``LeastLoadedDeviceSetter``, ``compat/placement.py``) places
parameter-server variables. What is left — merging (grad, var) lists (splitting them,
which ``aggregate_grads`` uses, is in ``transport/in_process.py`` and re-exported
here), the colocated and naive aggregations, the fixed-split ``GradientPacker`` and
``OverrideCachingDevice`` — is here, for code ported from tensorpack, and re-exported
from ``unison._collectives``.
"""

from __future__ import annotations

import logging
import typing
from collections.abc import Sequence
from typing import Any

import torch

from unison._collectives.compat.placement import VariableLike, check_devices, least_loaded, num_elements
from unison._collectives.transport.in_process import (
    aggregate_grads,
    check_average,
    check_grads,
    split_grad_list,
    sum_on,
)
from unison._collectives.transport.packing import check_count, flatten_tensors, split_sizes, unflatten_tensors
from unison._devices import canonicalize, canonicalize_all, torch_device
from unison.errors import UsageError

__all__ = [
    "split_grad_list",
    "merge_grad_list",
    "aggregate_grads_colocate",
    "allreduce_grads_naive",
    "GradientPacker",
    "OverrideCachingDevice",
]

logger = logging.getLogger(__name__)


def merge_grad_list(
    all_grads: Sequence[Sequence[Any]], all_vars: Sequence[Sequence[Any]]
) -> list[list[tuple[Any, Any]]]:
    """Zips K x N gradients and K x N variables into K lists of N (grad, var) pairs.

    tensorpack equivalent: ``merge_grad_list``.

    Raises:
        ValueError: if the two lists differ in K or in any N.
    """
    grad_shape = [len(g) for g in all_grads]
    var_shape = [len(v) for v in all_vars]
    if grad_shape != var_shape:
        raise ValueError(
            f"`all_grads` has per-device lengths {grad_shape} but `all_vars` has {var_shape}: "
            f"pass one variable per gradient on every device"
        )
    return [list(zip(gs, vs)) for gs, vs in zip(all_grads, all_vars)]


def aggregate_grads_colocate(
    all_grads: Sequence[Sequence[tuple[torch.Tensor, Any]]], average: bool = True
) -> list[tuple[torch.Tensor, Any]]:
    """:func:`aggregate_grads` with each aggregation on its variable's device.

    tensorpack equivalent: ``aggregate_grads_colocate``.
    """
    return aggregate_grads(all_grads, colocation=True, average=average)


def allreduce_grads_naive(
    all_grads: Sequence[Sequence[torch.Tensor]], devices: Sequence[str] | None = None, average: bool = True
) -> list[torch.Tensor]:
    """Aggregates K lists of N gradients into one list of N with plain tensor adds.

    With ``devices``, the work is spread round-robin starting from the *last* gradient
    (the first one backward produces), as tensorpack does to balance the model's tail;
    without, each sum is formed on the device of device 0's gradient.

    tensorpack equivalent: ``allreduce_grads_naive``.

    Returns:
        N summed (or averaged) gradients; with K == 1, ``all_grads[0]`` as a list.

    Raises:
        ValueError / TypeError: if the lists are empty, ragged or mismatched.
    """
    places = [torch_device(name) for name in canonicalize_all(devices)] if devices is not None else None
    num_devices, num_grads = check_grads(all_grads)
    if num_devices == 1:
        return list(all_grads[0])
    divisor = num_devices if average else 1
    result = []
    for n in range(num_grads):
        grads = [all_grads[k][n] for k in range(num_devices)]
        check_average(grads, n, average)
        place = places[(num_grads - 1 - n) % len(places)] if places is not None else grads[0].device
        total = sum_on(grads, place)
        result.append(total.div_(divisor) if divisor != 1 else total)
    return result


@typing.final
class GradientPacker:
    """Concatenates one device's gradients and splits them into ``num_split`` equal packs.

    Fewer, larger all-reduces are faster than many small ones. ``compute_strategy`` is
    called once with one device's gradients and decides whether packing pays off; the
    same layout then packs and unpacks every device's gradients.

    tensorpack equivalent: ``graph_builder.utils.GradientPacker``. Devices are unison
    device names (``"cpu:1"``, ``"cuda:0"``, TF spellings accepted); logical CPU
    devices all map to the host.

    Args:
        num_split: number of packs per device.

    Raises:
        ValueError: if ``num_split < 1``.
    """

    def __init__(self, num_split: int = 8) -> None:
        self._num_split = check_count("num_split", num_split, 1)
        self._decided: bool | None = None
        self._shapes: list[torch.Size] = []
        self._sizes: list[int] = []
        self._split_sizes: list[int] = []
        self._grad_dtype: torch.dtype | None = None

    def compute_strategy(self, grads: Sequence[torch.Tensor]) -> bool:
        """Decides the packing layout from one device's gradients.

        Returns:
            False (nothing is packed) when the gradients are fewer than 1024 elements per
            split, mix dtypes or devices, or are not all dense; else True.

        Raises:
            RuntimeError: on a second call (the layout is fixed once, as in tensorpack).
            TypeError: if an item is not a tensor.
        """
        if self._decided is not None:
            raise UsageError("GradientPacker.compute_strategy may be called only once; create a new GradientPacker")
        for i, g in enumerate(grads):
            if not isinstance(g, torch.Tensor):
                raise TypeError(f"`grads[{i}]` must be a torch.Tensor, got {type(g).__name__}: {g!r}")
        self._decided = False
        if any(g.layout != torch.strided for g in grads):
            logger.info("Skip GradientPacker: sparse gradients cannot be concatenated.")
            return False
        self._shapes = [g.shape for g in grads]
        self._sizes = [g.numel() for g in grads]
        total = sum(self._sizes)
        if total / self._num_split < 1024:
            logger.info("Skip GradientPacker: too few gradient elements (%d).", total)
            return False
        if len({g.dtype for g in grads}) != 1 or len({g.device for g in grads}) != 1:
            logger.info("Skip GradientPacker: gradients differ in dtype or device.")
            return False
        self._grad_dtype = grads[0].dtype
        self._split_sizes = split_sizes(total, self._num_split)
        logger.info("Will pack %d gradients of %d elements into %d splits.", len(grads), total, self._num_split)
        self._decided = True
        return True

    def _require_strategy(self) -> None:
        if not self._decided:
            raise UsageError(
                "GradientPacker has no packing layout: call compute_strategy(grads) first and "
                "pack only when it returned True"
            )

    def pack(self, grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Returns ``num_split`` 1-D packs (views of one new buffer) of ``grads``.

        Raises:
            ValueError: if ``grads`` differ in count, shape or dtype from the layout.
        """
        self._require_strategy()
        if len(grads) != len(self._shapes):
            raise ValueError(f"`grads` has {len(grads)} tensors but the layout has {len(self._shapes)}")
        for i, g in enumerate(grads):
            if g.shape != self._shapes[i] or g.dtype != self._grad_dtype:
                raise ValueError(
                    f"`grads[{i}]` is {g.dtype} {tuple(g.shape)} but the layout expects "
                    f"{self._grad_dtype} {tuple(self._shapes[i])}: pack the same gradients on every device"
                )
        return list(flatten_tensors(grads).split(self._split_sizes))

    def unpack(self, grad_packs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Returns the gradients, shaped as at ``compute_strategy``, from (reduced) packs.

        Raises:
            ValueError: if the packs hold a different number of elements.
        """
        self._require_strategy()
        return unflatten_tensors(torch.cat(list(grad_packs)), self._shapes)

    @staticmethod
    def _devices(devices: Sequence[str], count: int) -> list[torch.device]:
        if isinstance(devices, str) or len(devices) != count:
            raise ValueError(f"`devices` must list one device per gradient list ({count}), got {devices!r}")
        return [torch_device(canonicalize(d)) for d in devices]

    def pack_all(self, all_grads: Sequence[Sequence[torch.Tensor]], devices: Sequence[str]) -> list[list[torch.Tensor]]:
        """Packs K lists of gradients, device ``k``'s packs on ``devices[k]`` (K x num_split)."""
        places = self._devices(devices, len(all_grads))
        return [self.pack([g.to(place) for g in grads]) for place, grads in zip(places, all_grads)]

    def unpack_all(
        self, all_packed: Sequence[Sequence[torch.Tensor]], devices: Sequence[str]
    ) -> list[list[torch.Tensor]]:
        """Unpacks K lists of packs, device ``k``'s gradients on ``devices[k]`` (K x N)."""
        places = self._devices(devices, len(all_packed))
        return [self.unpack([p.to(place) for p in packs]) for place, packs in zip(places, all_packed)]


@typing.final
class OverrideCachingDevice:
    """Chooses where each variable's read cache lives: small ones together, large ones balanced.

    Variables with fewer than ``small_variable_size_threshold`` elements are cached on
    ``device_for_small_variables`` (not counted in the loads); larger ones on the
    least-loaded of ``devices``. Non-trainable variables get no caching device (``None``),
    as the reference makes them local, uncached variables.

    tensorpack equivalent: ``OverrideCachingDevice``, a variable getter that sets
    ``caching_device``; here the caller asks for the device and makes the cache itself.

    Args:
        devices: devices among which large variables are balanced.
        device_for_small_variables: the device for small variables.
        small_variable_size_threshold: element count below which a variable is small.

    Raises:
        ValueError: if ``devices`` is empty or the threshold is negative.
    """

    def __init__(
        self, devices: Sequence[Any], device_for_small_variables: Any, small_variable_size_threshold: int
    ) -> None:
        self.devices = check_devices(devices, "devices")
        self.sizes = [0] * len(self.devices)
        self.device_for_small_variables = device_for_small_variables
        if isinstance(small_variable_size_threshold, bool) or not isinstance(small_variable_size_threshold, int):
            raise TypeError(
                f"`small_variable_size_threshold` must be an int, got {small_variable_size_threshold!r}"
            )
        if small_variable_size_threshold < 0:
            raise ValueError(f"`small_variable_size_threshold` must be >= 0, got {small_variable_size_threshold!r}")
        self.small_variable_size_threshold = small_variable_size_threshold

    def __call__(self, var: VariableLike, trainable: bool = True) -> Any:
        """Returns the caching device for ``var`` (a tensor, shape or element count), or None.

        Raises:
            TypeError / ValueError: if ``var`` has no element count, or a negative one.
        """
        size = num_elements(var, "var")
        if not trainable:
            return None
        if size < self.small_variable_size_threshold:
            return self.device_for_small_variables
        index = least_loaded(self.sizes)
        self.sizes[index] += size
        return self.devices[index]
