"""Device names: TensorFlow and PyTorch spellings to one canonical form.

unison names a replica device ``"cpu:K"`` or ``"cuda:K"``. ``"cpu:1"`` is a *logical*
CPU device: it runs on the host like ``"cpu:0"`` but holds its own copy of every
mirrored variable, which is how several replicas are tested on one CPU (as
TensorFlow's logical devices are).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Sequence

import torch

__all__ = ["canonicalize", "canonicalize_all", "torch_device", "local_devices", "is_cuda"]

_TF_FORM = re.compile(
    r"^(?:/job:[\w-]+)?(?:/replica:\d+)?(?:/task:\d+)?/?(?:device:)?(?P<kind>[A-Za-z]+)(?::(?P<index>\d+))?$"
)
_KINDS = {"cpu": "cpu", "gpu": "cuda", "cuda": "cuda"}


def canonicalize(device: str | torch.device) -> str:
    """Returns the canonical ``"cpu:K"`` / ``"cuda:K"`` name of ``device``.

    Accepts ``torch.device`` objects and strings in either spelling: ``"GPU:0"``,
    ``"/device:GPU:1"``, ``"/job:worker/task:0/device:CPU:0"``, ``"cuda:0"``, ``"cpu"``.

    Raises:
        ValueError: if the string is not a device name of a supported kind.
    """
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}: {device!r}")
    return _canonicalize(device)


@functools.lru_cache(maxsize=1024)
def _canonicalize(device: str | torch.device) -> str:
    """``canonicalize`` proper, cached: every reduce of a batch names its destinations."""
    kind: str | None
    index: int | None
    if isinstance(device, torch.device):
        kind, index = device.type, device.index
    elif isinstance(device, str):
        match = _TF_FORM.match(device.strip())
        kind = match.group("kind").lower() if match else None
        if match is None or kind not in _KINDS:
            raise ValueError(
                f"device {device!r} is not a device name: use 'cpu:K' or 'cuda:K' "
                f"(PyTorch form) or 'CPU:K' / 'GPU:K' / '/device:GPU:K' (TensorFlow form)"
            )
        index = int(match.group("index")) if match.group("index") is not None else None
    kind = _KINDS.get(kind, kind)
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r} has unsupported type {kind!r}: unison runs on 'cpu' and 'cuda'")
    return f"{kind}:{index or 0}"


def canonicalize_all(devices: Iterable[str | torch.device], *, field: str = "devices") -> tuple[str, ...]:
    """Canonicalises a device list and rejects an empty list or duplicates."""
    if isinstance(devices, (str, torch.device)):
        devices = [devices]
    names = tuple(canonicalize(d) for d in devices)
    if not names:
        raise ValueError(f"`{field}` is empty: give at least one device, e.g. ['cpu:0']")
    seen: set[str] = set()
    for original, name in zip(devices, names):
        if name in seen:
            raise ValueError(
                f"`{field}` lists device {original!r} twice (as {name!r}): each replica needs its own device"
            )
        seen.add(name)
    return names


def torch_device(name: str) -> torch.device:
    """The torch device that holds tensors of the canonical device ``name``.

    Logical CPU devices all map to the host: ``torch_device("cpu:3") == cpu``.
    """
    kind, _, index = name.partition(":")
    return torch.device("cpu") if kind == "cpu" else torch.device(kind, int(index))


def is_cuda(name: str) -> bool:
    """Whether the canonical device ``name`` is a CUDA device."""
    return name.startswith("cuda:")


def local_devices() -> Sequence[str]:
    """All CUDA devices of this machine, else the one CPU device."""
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return tuple(f"cuda:{i}" for i in range(torch.cuda.device_count()))
    return ("cpu:0",)
