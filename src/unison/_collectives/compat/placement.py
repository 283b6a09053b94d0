"""Least-loaded placement of variables on parameter-server devices.

Parameter-server training spreads variables over several ps devices; giving each new
variable to the device holding the fewest elements so far keeps their memory and
traffic balanced. TensorFlow expresses this as device functions and variable getters
on graph ops; PyTorch has no graph ops, so here the chooser is called with the
variable (a tensor or ``nn.Parameter``), its shape, or its element count, and returns
the device to put it on. Device entries are returned exactly as given (a unison device
name, a ``torch.device``, a task name such as ``"ps:1"``, or a ps task index): the
setter only chooses. ``ParameterServerStrategy(variable_placer="least_loaded")`` uses
it with ps task indices (``unison._ps.remote_variables.variable_policy``), and the chosen ps task then holds the
variable behind unison's own tensor protocol (``unison._ps.wire.links``).

It lives here, below ``unison._ps``, although it is placement onto ps tasks: the
collectives layer needs it too (``unison._collectives`` exports ``LeastLoadedDeviceSetter``
for code ported from tensorpack, and ``OverrideCachingDevice`` in ``compat/tensorpack.py``
balances with the same rule), and no layer may import a higher one
(``tests/architecture/test_layers.py``). ``unison._ps`` imports it from
``unison._collectives``, the only module that imports ``compat/``.

tensorpack equivalent: ``graph_builder.utils.LeastLoadedDeviceSetter`` (from
tf_cnn_benchmarks' ``variable_mgr_util``); its ``OverrideCachingDevice`` is in
``compat/tensorpack.py``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["LeastLoadedDeviceSetter"]

VariableLike = torch.Tensor | torch.Size | Sequence[int] | int


def num_elements(var: VariableLike, field: str) -> int:
    """Elements of a tensor, a shape, or an explicit non-negative count."""
    if isinstance(var, torch.Tensor):
        return var.numel()
    if isinstance(var, bool):
        raise TypeError(f"`{field}` must be a tensor, a shape or an element count, got a bool")
    if isinstance(var, int):
        if var < 0:
            raise ValueError(f"`{field}` element count must be >= 0, got {var!r}")
        return var
    if isinstance(var, Sequence) and all(isinstance(d, int) and not isinstance(d, bool) for d in var):
        if any(d < 0 for d in var):
            raise ValueError(f"`{field}` shape {tuple(var)!r} has a negative dimension")
        return math.prod(var)
    raise TypeError(f"`{field}` must be a tensor, a shape or an element count, got {type(var).__name__}: {var!r}")


def check_devices(devices: Any, field: str) -> list[Any]:
    if isinstance(devices, (str, torch.device)) or not isinstance(devices, Sequence) or not devices:
        raise ValueError(f"`{field}` must be a non-empty list of devices, got {devices!r}")
    return list(devices)


def least_loaded(sizes: list[int]) -> int:
    """Index of the smallest load; ties go to the first device."""
    return min(range(len(sizes)), key=sizes.__getitem__)


class LeastLoadedDeviceSetter:
    """Puts each variable on the ps device with the fewest elements so far; the rest on the worker.

    Call it for every object you create: variables (``nn.Parameter``, or anything with
    ``is_variable=True``) go to the least-loaded ps device, everything else (activations,
    buffers you keep local, modules) to ``worker_device`` — the rule of the reference.
    TF's first rule, "keep an op's explicit device", has no counterpart: every PyTorch
    tensor has a device, so simply do not ask the setter about objects you pinned.

    tensorpack equivalent: ``LeastLoadedDeviceSetter`` used as ``tf.device(setter)``.

    Example:
        >>> setter = LeastLoadedDeviceSetter("cuda:0", ["ps:0", "ps:1"])
        >>> [setter.place_with_balance(n) for n in (100, 10, 20)]
        ['ps:0', 'ps:1', 'ps:1']

    Args:
        worker_device: where non-variables go (``None``: no preference).
        ps_devices: the devices that hold variables.

    Raises:
        ValueError: if ``ps_devices`` is empty or not a list.
    """

    def __init__(self, worker_device: Any, ps_devices: Sequence[Any]) -> None:
        self.worker_device = worker_device
        self.ps_devices = check_devices(ps_devices, "ps_devices")
        self.ps_sizes = [0] * len(self.ps_devices)

    def __call__(self, obj: Any, is_variable: bool | None = None) -> Any:
        """Returns the device for ``obj``: a ps device for variables, else the worker device.

        Args:
            obj: the object being placed.
            is_variable: whether ``obj`` is a variable; default: ``isinstance(obj, nn.Parameter)``.
        """
        if is_variable is None:
            is_variable = isinstance(obj, torch.nn.Parameter)
        return self.place_with_balance(obj) if is_variable else self.worker_device

    def place_with_balance(self, var: VariableLike) -> Any:
        """Returns the least-loaded ps device (first on ties) and adds ``var``'s elements to it.

        Args:
            var: a tensor, its shape, or its number of elements.

        Raises:
            TypeError / ValueError: if ``var`` has no element count, or a negative one.
        """
        size = num_elements(var, "var")
        index = least_loaded(self.ps_sizes)
        self.ps_sizes[index] += size
        return self.ps_devices[index]

    def __repr__(self) -> str:
        return f"LeastLoadedDeviceSetter(worker_device={self.worker_device!r}, ps_devices={self.ps_devices!r})"


