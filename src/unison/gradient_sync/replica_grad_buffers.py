"""Flat gradient buffers for CPU replica threads: one reduction per dtype, not one per gradient.

Reducing the gradients of a 400-parameter model across two CPU replicas with
``_foreach`` calls costs three small kernels per gradient and a Python walk over all
of them, about 2.5 ms of a 28 ms step (``benchmarks/in_process.py`` W2), with every
other replica waiting. Here each replica's gradients are aliases of one flat buffer
per dtype (DDP's ``gradient_as_bucket_view``), so the merge is an add, a multiply and
a copy over whole buffers. The price is paid in parallel instead: autograd adds each
gradient into its slot (one small kernel, in the replica's own thread) where it would
have taken over the new tensor. W2: merge 3.2-3.9 ms -> 1.1-1.5 ms, backward about
+1 ms per replica, step 3-9% faster. Large gradients stay out (see SMALL_GRADIENT).
Copying the gradients into a buffer at the end of backward and back after the merge,
without aliasing them, measured slower: 1.0-1.2 ms per replica to copy in (one
``flatten_dense_tensors`` or ``_foreach_copy_``, under a contended GIL) and 0.5-0.6 ms
to copy out, against 0.2-0.4 ms to point the gradients at their slots.

``zero_grad()`` keeps its meaning: the gradients are None after it. When a replica's
backward pass produces its first gradient, the gradients still None are pointed at
zeroed slots of the buffer, so autograd accumulates into them in place; at the merge a
slot autograd did not touch (its version counter did not move) is a gradient that was
never produced, and ends as None again. Gradients that arrive as other tensors (the
first one, one the user set) are copied into their slot. A buffer is reused only while
nothing outside holds one of its aliases or its storage; otherwise the replica gets a
fresh one, so a gradient a user kept from an earlier step is never overwritten.
"""

from __future__ import annotations

import operator
import sys
import threading
import typing
from collections import defaultdict
from typing import Any, Sequence

import torch

from unison.gradient_sync.grad_access import grads_of, set_grads

__all__ = ["ReplicaGradBuffers"]

SMALL_GRADIENT = 32768
"""Elements up to which a gradient goes into the buffers. Autograd accumulating into a
slot costs an add where it would take over a new tensor: for a large gradient a pass
over its bytes, more than its per-tensor share of the merge saves."""
MIN_GRADIENTS = 32
"""Fewer small gradients than this keep the general path: the buffers' fixed cost per
step exceeds what they save on a handful of ``_foreach`` entries."""


def _eligible(tensor: torch.Tensor) -> bool:
    return (tensor.layout == torch.strided and tensor.device.type == "cpu"
            and (tensor.is_floating_point() or tensor.is_complex()))


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
_use_count = torch._C.TensorBase._use_count  # type: ignore[attr-defined]
_version = operator.attrgetter("_version")


def _fits(grad: torch.Tensor, slot: torch.Tensor) -> bool:
    """Whether ``grad`` can be copied into ``slot`` and replaced by it (not a gradient
    carrying a graph, from ``backward(create_graph=True)``)."""
    return grad.shape == slot.shape and grad.dtype == slot.dtype and not grad.requires_grad and _eligible(grad)


@typing.final
class _ReplicaBuffers:
    """One replica's flat buffers (one per dtype) and the per-parameter aliases into them."""

    def __init__(self, components: Sequence[Any]):
        self.components = list(components)
        sizes: dict[torch.dtype, int] = defaultdict(int)
        for c in self.components:
            sizes[c.dtype] += c.numel()
        self.flats = {dtype: torch.zeros(size, dtype=dtype) for dtype, size in sizes.items()}
        offsets: dict[torch.dtype, int] = defaultdict(int)
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
    def _storage_uses(flat: torch.Tensor) -> int:
        return torch._C._storage_Use_Count(flat.untyped_storage()._cdata)

    def restore_untouched(self) -> None:
        """Gradients pointed at a zeroed slot that autograd never wrote are None again."""
        with torch._C.DisableTorchFunctionSubclass():
            for k in self.untouched:
                component, alias = self.components[k], self.aliases[k]
                if component.grad is alias and alias._version == self.versions[k]:
                    component.grad = None
        self.untouched = []

    def held_elsewhere(self, grads: list) -> bool:
        """Whether anything besides these buffers and the parameters' ``.grad`` holds an alias
        or a buffer's storage (a gradient kept from an earlier step, a view of one)."""
        aliases = self.aliases
        free = _FREE_REFS
        # held by self.aliases only, or also, while it is a parameter's gradient, by the
        # parameter and by `grads`; _use_count counts holders outside Python (a tensor
        # autograd saved for a later backward)
        references, uses = _references(aliases), list(map(_use_count, aliases))
        if references.count(free) != len(aliases) or uses.count(1) != len(aliases):  # not all free
            for k, (alias, grad) in enumerate(zip(aliases, grads)):
                installed = grad is alias
                if references[k] != (free + 2 if installed else free) or uses[k] != (2 if installed else 1):
                    return True
        return any(self._storage_uses(flat) != self.storage_uses[dtype] for dtype, flat in self.flats.items())


@typing.final
class ReplicaGradBuffers:
    """Flat per-replica gradient buffers for the trainable variables of one CPU strategy.

    Args:
        num_replicas: the local replicas; replica ``i``'s gradients live in buffer ``i``.
    """

    def __init__(self, num_replicas: int):
        self._num_replicas = num_replicas
        self._key: Any = None  # what the caller says identifies the registered variables
        self._replicas: list[_ReplicaBuffers] = []
        self._covered: frozenset[int] = frozenset()  # positions of the variables in the buffers
        self._build_lock = threading.Lock()  # replica threads meet a new layout at the same time

    def _layout(self, variables: Sequence[Any], key: Any) -> "list[_ReplicaBuffers] | None":
        """The buffers for ``variables``, made when ``key`` is not the current layout's."""
        if key == self._key:
            return self._replicas or None
        with self._build_lock:
            if key == self._key:
                return self._replicas or None
            self._restore_untouched()
            with torch._C.DisableTorchFunctionSubclass():
                components = [[v._component(i) for v in variables]  # type: ignore[attr-defined]
                              for i in range(self._num_replicas)]
            covered = [k for k in range(len(variables))
                       if all(_eligible(replica[k]) and replica[k].numel() <= SMALL_GRADIENT for replica in components)]
            if len(covered) < MIN_GRADIENTS:
                covered = []
            self._covered = frozenset(covered)
            self._replicas = [_ReplicaBuffers([replica[k] for k in covered]) for replica in components] if covered else []
            self._key = key
            return self._replicas or None

    def install(self, replica_id: int, variables: Sequence[Any], key: Any) -> None:
        """At the first gradient of a replica's backward pass: points the gradients that are
        None at zeroed slots of the replica's buffer, so autograd accumulates into them, and
        moves a gradient that arrived as a tensor of its own (this first one) into its slot.

        ``variables`` are every registered trainable variable, in order; ``key`` changes
        whenever they do (a registration, a variable collected).
        """
        replicas = self._layout(variables, key)
        if replicas is None:
            return
        buffers = replicas[replica_id]
        with torch._C.DisableTorchFunctionSubclass():
            grads = grads_of(buffers.components)
            if all(map(operator.is_, grads, buffers.aliases)):
                return  # accumulating into the slots already (no zero_grad since the last step)
            if buffers.held_elsewhere(grads):
                buffers = replicas[replica_id] = _ReplicaBuffers(buffers.components)
            aliases = buffers.aliases
            if any(map(operator.is_, grads, aliases)):
                for g, a in zip(grads, aliases):
                    if g is not a:
                        a.zero_()
            else:
                for flat in buffers.flats.values():
                    flat.zero_()
            buffers.versions = list(map(_version, aliases))
            untouched = buffers.untouched = [k for k, g in enumerate(grads) if g is None]
            components = buffers.components
            try:
                # the setter checks the shape: raises for a resized parameter
                set_grads([components[k] for k in untouched], [aliases[k] for k in untouched])
                for k, grad in enumerate(grads):
                    if grad is not None and grad is not aliases[k] and _fits(grad, aliases[k]):
                        aliases[k].copy_(grad)
                        components[k].grad = aliases[k]
            except RuntimeError:  # a parameter was resized (param.data = ...): a new layout next time
                buffers.restore_untouched()
                self._key = None

    def _restore_untouched(self) -> None:
        for r in self._replicas:
            r.restore_untouched()

    def reduce(self, variables: Sequence[Any], key: Any, mean: bool) -> "list[Any] | None":
        """Reduces every replica's gradients of the variables in the buffers, out of
        ``variables`` (all the registered ones), and returns the others, for the general
        path. None, when they cannot be: then the gradients are as autograd left them
        (slots it never wrote are None again) and all take the general path."""
        replicas = self._replicas
        if not replicas:
            return None
        if key != self._key:  # not every registered variable (opt.step() without backward), or new ones
            self._restore_untouched()
            return None
        with torch._C.DisableTorchFunctionSubclass():
            per_replica = [grads_of(r.components) for r in replicas]
            in_slots = all(all(map(operator.is_, grads, r.aliases)) for r, grads in zip(replicas, per_replica))
            if not in_slots and not self._into_slots(per_replica):
                self._restore_untouched()
                return None
            # a slot no replica's autograd wrote since it was zeroed is a gradient never produced
            never_written: "set[int] | None" = None
            for r in replicas:
                versions, now = r.versions, list(map(_version, r.aliases))
                unwritten = {k for k in r.untouched if now[k] == versions[k]}
                never_written = unwritten if never_written is None else never_written & unwritten
                r.untouched = []
            self._reduce_flats(mean)
            for k in never_written or ():
                for r in replicas:
                    r.components[k].grad = None
        covered = self._covered
        if len(covered) == len(variables):
            return []
        return [v for k, v in enumerate(variables) if k not in covered]

    def _into_slots(self, per_replica: list[list]) -> bool:
        """Moves gradients that are not their slot into it (a None one as a zero slot autograd
        never wrote); False, changing nothing, if one cannot live in a buffer."""
        replicas = self._replicas
        for r, grads in zip(replicas, per_replica):
            if not all(g is None or g is a or _fits(g, a) for g, a in zip(grads, r.aliases)):
                return False
        for r, grads in zip(replicas, per_replica):
            untouched = set(r.untouched)
            for k, (component, g, a) in enumerate(zip(r.components, grads, r.aliases)):
                if g is a:
                    continue
                if g is None:
                    a.zero_()
                    untouched.add(k)
                else:
                    a.copy_(g)
                component.grad = a
            r.untouched = sorted(untouched)
            r.versions = [a._version for a in r.aliases]
        return True

    def _reduce_flats(self, mean: bool) -> None:
        """Replica 0's buffers become the sum (the mean) of all replicas', copied into the others'."""
        replicas = self._replicas
        firsts = replicas[0].flats
        for other in replicas[1:]:
            for dtype, flat in other.flats.items():
                firsts[dtype].add_(flat)
        if mean:
            n = self._num_replicas
            for flat in firsts.values():
                if n & (n - 1) == 0:  # x * (1 / 2**k) is x / 2**k exactly, and multiplies faster
                    flat.mul_(1.0 / n)
                else:
                    flat.div_(float(n))
        for other in replicas[1:]:
            for dtype, flat in other.flats.items():
                flat.copy_(firsts[dtype])
