"""K x N gradient lists: split, merge, all-reduce and aggregate across devices in one process.

A gradient list in tensorpack's format is K lists (one per device, or "tower") of N
gradient tensors, gradient ``n`` of every list belonging to the same variable. These
small functions are what the in-process CrossDeviceOps and the parameter-server
strategy compose; each checks its input at the boundary.

Reductions in one process add in a fixed order (device 0, 1, ..., K-1), so every device
receives bit-identical values and results equal a plain ``sum`` (divided by K for the
mean). Each device gets its own output tensor on its own device, so updating one
device's result in place never changes another's, even for logical CPU devices that
share the host.

tensorpack equivalent: ``tensorpack.graph_builder.utils``; TF graph ops and
``tf.device`` scopes become eager tensor ops and ``Tensor.to(device)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from unison._devices import canonicalize, canonicalize_all, torch_device
from unison._interpose.torch_private import has_nccl_all_reduce

__all__ = [
    "split_grad_list",
    "allreduce_grads",
    "allreduce_grads_hierarchical",
    "aggregate_grads",
]

_MODES = ("nccl", "collective")


def check_grads(all_grads: Any, name: str = "all_grads") -> tuple[int, int]:
    """Checks K >= 1 lists of N tensors with equal shapes and dtypes; returns (K, N)."""
    if isinstance(all_grads, torch.Tensor) or not isinstance(all_grads, Sequence):
        raise TypeError(f"`{name}` must be a list of K per-device lists of tensors, got {type(all_grads).__name__}")
    if len(all_grads) == 0:
        raise ValueError(f"`{name}` is empty: pass one list of tensors per device (K >= 1)")
    lengths = []
    for k, grads in enumerate(all_grads):
        if isinstance(grads, torch.Tensor) or not isinstance(grads, Sequence):
            raise TypeError(f"`{name}[{k}]` must be a list of tensors, got {type(grads).__name__}")
        lengths.append(len(grads))
    if len(set(lengths)) != 1:
        raise ValueError(
            f"`{name}` has per-device lists of lengths {lengths}: every device must list the same "
            f"N tensors in the same order; fix the lists whose length differs from {lengths[0]}"
        )
    for k, grads in enumerate(all_grads):
        for n, g in enumerate(grads):
            if not isinstance(g, torch.Tensor):
                hint = " (filter out variables without a gradient on every device first)" if g is None else ""
                raise TypeError(f"`{name}[{k}][{n}]` must be a torch.Tensor, got {type(g).__name__}{hint}")
            if k == 0:
                continue  # device 0 is what the others are compared with
            first = all_grads[0][n]
            if g.shape != first.shape or g.dtype != first.dtype:
                raise ValueError(
                    f"`{name}[{k}][{n}]` is {g.dtype} {tuple(g.shape)} but `{name}[0][{n}]` is "
                    f"{first.dtype} {tuple(first.shape)}: entry n of every device must be the same variable's"
                )
    return len(all_grads), lengths[0]


def check_pairs(grad_list: Any, name: str) -> None:
    if isinstance(grad_list, torch.Tensor) or not isinstance(grad_list, Sequence) or not grad_list:
        raise ValueError(f"`{name}` must be a non-empty list of K per-device lists of (grad, var) pairs")
    for k, tower in enumerate(grad_list):
        for n, pair in enumerate(tower):
            if isinstance(pair, torch.Tensor) or not isinstance(pair, Sequence) or len(pair) != 2:
                raise TypeError(f"`{name}[{k}][{n}]` must be a (grad, var) pair, got {type(pair).__name__}")


def check_average(grads: Sequence[torch.Tensor], n: int, average: bool) -> None:
    g = grads[0]
    if average and not (g.is_floating_point() or g.is_complex()):
        raise TypeError(
            f"average=True needs floating-point gradients but gradient {n} is {g.dtype}: "
            f"pass average=False or cast the gradients"
        )


def sum_on(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """A new tensor on ``device``: ``tensors`` added in order (exactly ``sum(tensors)``)."""
    total = tensors[0].to(device, copy=True)
    for t in tensors[1:]:
        total.add_(t.to(device))
    return total


def _deliver(total: torch.Tensor, device: torch.device, divisor: int) -> torch.Tensor:
    """A copy of ``total`` on ``device`` that shares memory with nothing, divided by ``divisor``."""
    out = total.to(device, copy=True)
    return out.div_(divisor) if divisor != 1 else out


def split_grad_list(grad_list: Sequence[Sequence[tuple[Any, Any]]]) -> tuple[list[list[Any]], list[list[Any]]]:
    """Splits K lists of N (grad, var) pairs into K x N gradients and K x N variables.

    tensorpack equivalent: ``split_grad_list``.

    Raises:
        ValueError / TypeError: if ``grad_list`` is empty or holds something other than pairs.
    """
    check_pairs(grad_list, "grad_list")
    return [[pair[0] for pair in tower] for tower in grad_list], [[pair[1] for pair in tower] for tower in grad_list]


def _nccl_usable(grads: Sequence[torch.Tensor]) -> bool:
    if not has_nccl_all_reduce() or len(grads) < 2:
        return False
    if not all(g.is_cuda and g.layout == torch.strided for g in grads):
        return False
    return len({g.device.index for g in grads}) == len(grads)


def allreduce_grads(
    all_grads: Sequence[Sequence[torch.Tensor]], average: bool, mode: str = "nccl"
) -> list[list[torch.Tensor]]:
    """All-reduces K x N gradients: every device gets the sum (or mean) over the K devices.

    ``mode="nccl"`` calls ``torch.cuda.nccl.all_reduce`` (one NCCL clique inside this
    process) for a gradient whose K tensors sit on K distinct CUDA devices and PyTorch
    has NCCL; its sum order is NCCL's, so results match the oracle within float
    tolerance. Otherwise (CPU, logical CPU devices, several replicas on one GPU) it
    falls back to the exact in-process reduction. ``mode="collective"`` always uses the
    exact in-process reduction: TF's in-process collective ops have no PyTorch
    counterpart; cross-process collectives live in ``CollectiveAllReduce``.

    tensorpack equivalent: ``allreduce_grads``; the mean divides by K instead of
    multiplying by ``1.0 / K``, and the result is K lists instead of K tuples.

    Args:
        all_grads: K lists of N gradients; output ``k`` lives where ``all_grads[k][n]`` is.
        average: divide the sum by K.
        mode: ``"nccl"`` or ``"collective"``.

    Returns:
        K lists of N reduced tensors, never aliasing an input nor each other when K > 1.
        With K == 1 the input tensors are returned as they are.

    Raises:
        ValueError: if ``mode`` is unknown or the lists are empty, ragged, or mismatched.
        TypeError: if an entry is not a tensor, or ``average`` with integer gradients.
    """
    if mode not in _MODES:
        raise ValueError(f"mode {mode!r} is not an all-reduce mode: use one of {_MODES}")
    num_devices, num_grads = check_grads(all_grads)
    if num_devices == 1:
        return [list(all_grads[0])]
    divisor = num_devices if average else 1
    result: list[list[torch.Tensor]] = [[] for _ in range(num_devices)]
    for n in range(num_grads):
        grads = [all_grads[k][n] for k in range(num_devices)]
        check_average(grads, n, average)
        if mode == "nccl" and _nccl_usable(grads):
            outputs = [g.clone(memory_format=torch.contiguous_format) for g in grads]
            torch.cuda.nccl.all_reduce(outputs)
            reduced = [o.div_(divisor) if divisor != 1 else o for o in outputs]
        else:
            total = sum_on(grads, grads[0].device)
            if divisor != 1:
                total.div_(divisor)
            reduced = [total] + [total.to(g.device, copy=True) for g in grads[1:]]
        for k, tensor in enumerate(reduced):
            result[k].append(tensor)
    return result


def allreduce_grads_hierarchical(
    all_grads: Sequence[Sequence[torch.Tensor]], devices: Sequence[str], average: bool = False
) -> list[list[torch.Tensor]]:
    """All-reduces K x N gradients over exactly 8 devices in two groups of 4 (DGX-1 shape).

    For gradient ``n`` the leader of one group is device ``n % 8`` and of the other
    ``(n + 4) % 8``, so the work spreads over all devices. Each leader adds its group's
    four gradients, the second leader adds the first leader's partial sum, the total is
    copied back to the first leader, and every device copies its group leader's total.

    tensorpack equivalent: ``allreduce_grads_hierarchical``.

    Args:
        all_grads: 8 lists of N gradients.
        devices: the 8 device names (``"cuda:0"``..., or logical ``"cpu:0"``...``"cpu:7"``).
        average: divide the total by 8.

    Returns:
        8 lists of N reduced tensors; list ``k`` on ``devices[k]``. Sums are grouped as
        (group sum) + (group sum), so floats match a sequential sum within rounding.

    Raises:
        ValueError: if there are not exactly 8 devices, or ``all_grads`` does not match them.
    """
    names = canonicalize_all(devices, field="devices")
    if len(names) != 8:
        raise ValueError(
            f"hierarchical all-reduce needs exactly 8 devices (two groups of 4), got {len(names)}: "
            f"{list(names)!r}; use allreduce_grads for other device counts"
        )
    num_devices, num_grads = check_grads(all_grads)
    if num_devices != 8:
        raise ValueError(f"`all_grads` has {num_devices} device lists but `devices` names 8: pass one list per device")
    places = [torch_device(name) for name in names]
    group = 4
    divisor = 8 if average else 1
    result: list[list[torch.Tensor]] = [[] for _ in range(8)]
    for n in range(num_grads):
        grads = [all_grads[k][n] for k in range(8)]
        check_average(grads, n, average)
        lead0 = n % 8
        lead1 = (lead0 + group) % 8
        start0, start1 = (0, group) if lead0 < group else (group, 0)
        partial0 = sum_on(grads[start0 : start0 + group], places[lead0])
        total1 = sum_on(grads[start1 : start1 + group], places[lead1])
        total1.add_(partial0.to(places[lead1]))
        total0 = total1.to(places[lead0], copy=True)
        for k in range(8):
            leader_total = total0 if (k < group) == (lead0 < group) else total1
            result[k].append(_deliver(leader_total, places[k], divisor))
    return result


def _var_device(var: Any, n: int) -> torch.device:
    device = getattr(var, "device", None)
    if device is None:
        raise TypeError(
            f"colocation needs the device of variable {n} but {type(var).__name__} has no `.device`; "
            f"pass colocation=False or variables that are tensors"
        )
    return device if isinstance(device, torch.device) else torch_device(canonicalize(device))


def aggregate_grads(
    all_grads: Sequence[Sequence[tuple[torch.Tensor, Any]]],
    colocation: bool = False,
    devices: Sequence[str] | None = None,
    average: bool = True,
) -> list[tuple[torch.Tensor, Any]]:
    """Aggregates K lists of N (grad, var) pairs into one list of N (grad, var) pairs.

    The parameter-server pattern: one aggregated gradient per variable, computed where
    the variable lives (``colocation=True``), on ``devices`` in round-robin, or else on
    the device of the first device's gradient. The variable of each pair is device 0's.

    tensorpack equivalent: ``aggregate_grads``.

    Args:
        all_grads: K lists of N (grad, var) pairs; the variables are shared across K.
        colocation: aggregate on each variable's ``.device``.
        devices: aggregate gradient ``n`` on ``devices[n % len(devices)]``.
        average: mean instead of sum.

    Returns:
        N (grad, var) pairs; with K == 1, ``all_grads[0]`` as it is.

    Raises:
        ValueError: if both ``colocation`` and ``devices`` are given, or the lists are bad.
        TypeError: if a variable has no ``.device`` under colocation.
    """
    if colocation and devices is not None:
        raise ValueError(f"give `colocation=True` or `devices` ({devices!r}), not both")
    places = [torch_device(name) for name in canonicalize_all(devices)] if devices is not None else None
    grads_k, vars_k = split_grad_list(all_grads)
    num_devices, num_grads = check_grads(grads_k)
    if num_devices == 1:
        return list(all_grads[0])
    divisor = num_devices if average else 1
    result = []
    for n in range(num_grads):
        grads = [grads_k[k][n] for k in range(num_devices)]
        check_average(grads, n, average)
        var = vars_k[0][n]
        if colocation:
            place = _var_device(var, n)
        elif places is not None:
            place = places[n % len(places)]
        else:
            place = grads[0].device
        total = sum_on(grads, place)
        result.append((total.div_(divisor) if divisor != 1 else total, var))
    return result


