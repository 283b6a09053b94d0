"""Nested batches: checking, slicing and placing structures of tensors.

A batch is a tensor or a nested dict / list / tuple / namedtuple of tensors (anything
``torch.utils._pytree`` flattens) whose leaves share one leading (batch) dimension.
Checking every batch against the first one turns the usual late failures (a shape
error deep in a model, a list of Python ints silently sliced) into clear errors at the
step that went wrong.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from unison._devices import is_cuda, torch_device

__all__ = ["BatchChecker", "describe_structure", "slice_batch", "place_batch"]


class _Placeholder:
    __slots__ = ("text",)

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def describe_structure(spec: pytree.TreeSpec) -> str:
    """A short rendering of a batch structure, e.g. ``{'x': Tensor, 'y': Tensor}``."""
    return repr(pytree.tree_unflatten([_Placeholder("Tensor")] * spec.num_leaves, spec))


def _path_name(path: tuple[Any, ...]) -> str:
    return f"batch{pytree.keystr(path)}" if path else "batch"


class BatchChecker:
    """Checks each batch of one stream against the first batch of that stream.

    Args:
        what: how messages name a batch of this stream, e.g. ``"global batch"``.
    """

    def __init__(self, what: str):
        self._what = what
        self._spec: pytree.TreeSpec | None = None
        self._template: Any = None

    @property
    def seen(self) -> bool:
        """Whether a batch has been checked, so :meth:`empty_like` is available."""
        return self._spec is not None

    def check(self, batch: Any, step: int, where: str = "") -> int:
        """Checks ``batch`` (read at ``step``) and returns its number of rows.

        ``where`` optionally names the source in messages, e.g. ``" of local input pipeline 1"``.

        Raises:
            TypeError: if a leaf is not a tensor (the message names the leaf's path).
            ValueError: if the structure differs from the first batch's, a leaf has no
                batch dimension, the leaves disagree on the batch size, or there are no
                tensors at all.
        """
        label = f"{self._what} at step {step}{where}"
        with_paths, spec = pytree.tree_flatten_with_path(batch)
        for path, leaf in with_paths:
            if not isinstance(leaf, torch.Tensor):
                raise TypeError(
                    f"{label}: `{_path_name(path)}` is a {type(leaf).__name__} ({_short(leaf)}), not a "
                    f"torch.Tensor: every leaf of a batch must be a tensor; convert it in the dataset "
                    f"or collate_fn (e.g. torch.as_tensor)"
                )
        if not with_paths:
            raise ValueError(f"{label} holds no tensors ({batch!r}): yield a tensor or a structure of tensors")
        if self._spec is None:
            self._spec = spec
        elif spec != self._spec:
            raise ValueError(
                f"{label} has structure {describe_structure(spec)}, but the first {self._what} had "
                f"{describe_structure(self._spec)}: every batch must have the same nested structure"
            )
        sizes: dict[str, int] = {}
        for path, leaf in with_paths:
            if leaf.dim() == 0:
                raise ValueError(
                    f"{label}: `{_path_name(path)}` is a 0-d tensor with no batch dimension: every "
                    f"leaf needs a leading batch dimension (batch it, e.g. with a DataLoader)"
                )
            sizes[_path_name(path)] = leaf.shape[0]
        if len(set(sizes.values())) > 1:
            listing = ", ".join(f"`{name}`: {size}" for name, size in sizes.items())
            raise ValueError(
                f"{label}: leaves have different batch sizes ({listing}): every leaf must have the "
                f"same leading dimension"
            )
        if self._template is None:
            self._template = pytree.tree_map(lambda t: t.new_empty((0, *t.shape[1:])), batch)
        return next(iter(sizes.values()))

    def empty_like(self) -> Any:
        """A 0-row batch with the structure, dtypes and trailing shapes of the first batch.

        Raises:
            RuntimeError: if no batch has been checked yet.
        """
        if self._template is None:
            raise RuntimeError(f"no {self._what} checked yet: cannot build an empty one")
        return pytree.tree_map(lambda t: t.clone(), self._template)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def slice_batch(batch: Any, rows: slice) -> Any:
    """The rows ``rows`` of every leaf of ``batch`` (views, no copy)."""
    return pytree.tree_map(lambda t: t[rows], batch)


def place_batch(batch: Any, device: str, *, pin_memory: bool = False) -> Any:
    """Moves every leaf of ``batch`` to the canonical ``device``.

    For CUDA devices, ``pin_memory`` first copies host leaves to pinned memory, and
    copies from pinned memory are non-blocking. Logical CPU devices keep host tensors
    as they are.
    """
    target = torch_device(device)
    cuda = is_cuda(device)

    def move(t: torch.Tensor) -> torch.Tensor:
        if not cuda:
            return t.to(target)
        if pin_memory and t.device.type == "cpu" and not t.is_pinned():
            t = t.pin_memory()
        return t.to(target, non_blocking=t.device.type == "cpu" and t.is_pinned())

    return pytree.tree_map(move, batch)
