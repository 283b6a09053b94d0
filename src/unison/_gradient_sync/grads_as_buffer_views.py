"""Gradients that live in one flat buffer per dtype: DDP's ``gradient_as_bucket_view``, for CPU.

Reducing many small gradients costs a kernel (and often a Python step) per gradient to
gather them into a flat buffer and another to hand the result back. When the gradients
are aliases of slots of the flat buffer instead, autograd adds each one into its slot
(one small kernel, during backward, where it would have taken over the new tensor) and
the reduction reads and writes whole buffers.

``GradSlots`` owns the buffers and aliases for one list of parameters (one replica's
components, one worker's bucket). ``point_grads`` is called at the first gradient of a
backward pass: the gradients still None are pointed at zeroed slots, and gradients that
arrived as tensors of their own (that first one, one the user set) are copied into their
slot. Each alias has its own version counter (``set_`` onto the storage, not a view), so
a caller can tell a slot autograd never wrote. Buffers are reused only while nothing
outside holds an alias or their storage (``held_elsewhere``): a gradient a user kept from
an earlier step is never overwritten; the caller makes fresh slots instead.
"""

from __future__ import annotations

import operator
import sys
import typing
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch

from unison._gradient_sync.grad_access import set_grads
from unison._interpose.torch_private import TENSOR_USE_COUNT, storage_use_count

__all__ = ["GradSlots", "fits", "slot_eligible", "held_beyond"]


def slot_eligible(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s gradient can live in a CPU flat buffer (dense, floating or complex)."""
    return (tensor.layout == torch.strided and tensor.device.type == "cpu"
            and (tensor.is_floating_point() or tensor.is_complex()))


def fits(grad: torch.Tensor, slot: torch.Tensor) -> bool:
    """Whether ``grad`` can be copied into ``slot`` and replaced by it (not a gradient
    carrying a graph, from ``backward(create_graph=True)``)."""
    return grad.shape == slot.shape and grad.dtype == slot.dtype and not grad.requires_grad and slot_eligible(grad)


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _references(items: list) -> list[int]:
    """``sys.getrefcount`` of each of ``items``, in one C-level pass."""
    return list(map(sys.getrefcount, items))


_FREE_REFS = _references([torch.empty(0)])[0]
"""What ``_references`` counts for a tensor only a list holds. Measured, not assumed:
what ``sys.getrefcount`` adds for its own argument differs across Python versions."""
version_of = operator.attrgetter("_version")


def held_beyond(tensors: list[torch.Tensor], grads: list) -> bool:
    """Whether anything holds one of ``tensors`` (each held by one list) besides that list and,
    where it is the gradient, its parameter and ``grads`` (the parameters' gradients now): a
    Python reference, or a C++ holder such as a tensor autograd saved for a later backward.
    True where this torch cannot tell."""
    if TENSOR_USE_COUNT is None:
        return True
    free = _FREE_REFS
    references, uses = _references(tensors), list(map(TENSOR_USE_COUNT, tensors))
    if references.count(free) == len(tensors) and uses.count(1) == len(tensors):  # all free: the usual case
        return False
    for k, (tensor, grad) in enumerate(zip(tensors, grads)):
        installed = grad is tensor
        if references[k] != (free + 2 if installed else free) or uses[k] != (2 if installed else 1):
            return True
    return False


@typing.final
class GradSlots:
    """Flat buffers (one per dtype) for the gradients of ``components``, and an alias per component.

    The aliases are laid out one after another in the order of ``components`` within
    their dtype's buffer, as ``flat_buffers.views_of`` lays out tensors. ``home``: memory of
    the caller's to be the one buffer (components of one dtype, as many elements, contiguous:
    a slot of a shared file), instead of a buffer of their own.
    """

    def __init__(self, components: Sequence[Any], home: torch.Tensor | None = None):
        self.components = list(components)
        sizes: dict[torch.dtype, int] = defaultdict(int)
        for c in self.components:
            sizes[c.dtype] += c.numel()
        if home is not None:
            if list(sizes.items()) != [(home.dtype, home.numel())] or not home.is_contiguous():
                raise ValueError(f"home: {home.numel()} contiguous {home.dtype} elements do not hold gradients of "
                                 f"{dict(sizes)} elements; give one dtype's exact size")
            self.flats = {home.dtype: home}
        else:
            self.flats = {dtype: torch.zeros(size, dtype=dtype) for dtype, size in sizes.items()}
        offsets: dict[torch.dtype, int] = {dtype: int(flat.storage_offset()) for dtype, flat in self.flats.items()}
        self.aliases: list[torch.Tensor] = []
        for c in self.components:
            flat = self.flats[c.dtype]
            # set_() makes an alias with its own version counter (a view would share the
            # buffer's): its version moves only when this gradient is written
            alias = torch.empty(0, dtype=c.dtype).set_(flat.untyped_storage(), offsets[c.dtype], c.shape,
                                                       _contiguous_strides(c.shape))
            offsets[c.dtype] += c.numel()
            self.aliases.append(alias)
        self.storage_uses = {dtype: self._storage_uses(flat) for dtype, flat in self.flats.items()}
        self.untouched: list[int] = []  # the slots pointed at zeroed this backward, for gradients that were None
        self.versions: list[int] = []  # every alias's version counter once zeroed

    @staticmethod
    def _storage_uses(flat: torch.Tensor) -> int | None:
        return storage_use_count(flat)

    def in_slots(self, grads: list) -> bool:
        """Whether every gradient of ``grads`` (the components' now) is its slot."""
        return all(map(operator.is_, grads, self.aliases))

    def point_grads(self, grads: list, track_unwritten: bool = True) -> None:
        """Points the gradients that are None at zeroed slots (autograd then accumulates into
        them in place) and moves the others that fit into their slot. ``grads`` are the
        components' gradients now. With ``track_unwritten``, ``never_written`` tells the
        slots nothing wrote afterwards. Raises RuntimeError for a component resized since
        the slots were made (the ``.grad`` setter checks the shape); ``restore_untouched``
        then undoes the pointing (only with ``track_unwritten``)."""
        aliases = self.aliases
        if any(map(operator.is_, grads, aliases)):
            for g, a in zip(grads, aliases):
                if g is not a:
                    a.zero_()
        else:
            for flat in self.flats.values():
                flat.zero_()
        untouched = [k for k, g in enumerate(grads) if g is None]
        if track_unwritten:
            self.versions = list(map(version_of, aliases))
            self.untouched = untouched
        components = self.components
        if len(untouched) == len(grads):  # zero_grad() to None, the usual case: every one pointed
            set_grads(components, aliases)
            return
        set_grads([components[k] for k in untouched], [aliases[k] for k in untouched])
        for k, grad in enumerate(grads):
            if grad is not None and grad is not aliases[k] and fits(grad, aliases[k]):
                aliases[k].copy_(grad)
                components[k].grad = aliases[k]

    def never_written(self) -> set[int]:
        """The slots pointed at zeroed by the last ``point_grads`` that nothing wrote since."""
        now = list(map(version_of, self.aliases))
        return {k for k in self.untouched if now[k] == self.versions[k]}

    def restore_untouched(self) -> None:
        """Gradients pointed at a zeroed slot that autograd never wrote are None again."""
        with torch._C.DisableTorchFunctionSubclass():
            for k in self.untouched:
                component, alias = self.components[k], self.aliases[k]
                if component.grad is alias and alias._version == self.versions[k]:
                    component.grad = None
        self.untouched = []

    def held_elsewhere(self, grads: list) -> bool:
        """Whether anything besides these buffers and the components' ``.grad`` holds an alias
        or a buffer's storage (a gradient kept from an earlier step, a view of one)."""
        if held_beyond(self.aliases, grads):  # held (or this torch cannot tell): never reused
            return True
        return any(self._storage_uses(flat) != self.storage_uses[dtype] for dtype, flat in self.flats.items())
