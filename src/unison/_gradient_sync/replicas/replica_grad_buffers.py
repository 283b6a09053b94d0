"""Flat gradient buffers for CPU replica threads: one reduction per dtype, not one per gradient.

Reducing the gradients of a 400-parameter model across two CPU replicas with
``_foreach`` calls costs three small kernels per gradient and a Python walk over all of
them, with every other replica waiting. Here each replica's gradients are aliases of one
flat buffer per dtype (DDP's ``gradient_as_bucket_view``), so the merge is an add, a
multiply and a copy over whole buffers. The price is paid in parallel instead: autograd
adds each gradient into its slot (one small kernel, in the replica's own thread) where
it would have taken over the new tensor; the merge saves more than backward loses. Large
gradients stay out (see SMALL_GRADIENT). Copying the gradients into a buffer at the end
of backward and back after the merge, without aliasing them, measured slower: two copies
under a contended GIL against pointing the gradients at their slots
(``benchmarks/RESULTS.md``, 'Flat replica gradient buffers').

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

import threading
import typing
from collections.abc import Sequence
from typing import Any

import torch

from unison._collectives.ops.in_place_reduction import InPlaceReduction
from unison._gradient_sync.grad_access import grads_of
from unison._gradient_sync.grads_as_buffer_views import GradSlots, fits, slot_eligible

__all__ = ["ReplicaGradBuffers"]

SMALL_GRADIENT = 32768
"""Elements up to which a gradient goes into the buffers. Autograd accumulating into a
slot costs an add where it would take over a new tensor: for a large gradient a pass
over its bytes, more than its per-tensor share of the merge saves."""
MIN_GRADIENTS = 32
"""Fewer small gradients than this keep the general path: the buffers' fixed cost per
step exceeds what they save on a handful of ``_foreach`` entries."""


@typing.final
class ReplicaGradBuffers:
    """Flat per-replica gradient buffers for the trainable variables of one CPU strategy.

    Args:
        num_replicas: the local replicas; replica ``i``'s gradients live in buffer ``i``.
    """

    def __init__(self, num_replicas: int):
        self._num_replicas = num_replicas
        self._key: Any = None  # what the caller says identifies the registered variables
        self._replicas: list[GradSlots] = []
        self._covered: frozenset[int] = frozenset()  # positions of the variables in the buffers
        self._build_lock = threading.Lock()  # replica threads meet a new layout at the same time

    def _layout(self, variables: Sequence[Any], key: Any) -> list[GradSlots] | None:
        """The buffers for ``variables``, made when ``key`` is not the current layout's."""
        if key == self._key:
            return self._replicas or None
        with self._build_lock:
            if key == self._key:
                return self._replicas or None
            self._restore_untouched()
            with torch._C.DisableTorchFunctionSubclass():
                components = [[v.component(i) for v in variables]  # type: ignore[attr-defined]
                              for i in range(self._num_replicas)]
            covered = [k for k in range(len(variables))
                       if all(slot_eligible(replica[k]) and replica[k].numel() <= SMALL_GRADIENT
                              for replica in components)]
            if len(covered) < MIN_GRADIENTS:
                covered = []
            self._covered = frozenset(covered)
            self._replicas = [GradSlots([replica[k] for k in covered]) for replica in components] if covered else []
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
            if buffers.in_slots(grads):
                return  # accumulating into the slots already (no zero_grad since the last step)
            if buffers.held_elsewhere(grads):
                buffers = replicas[replica_id] = GradSlots(buffers.components)
            try:
                buffers.point_grads(grads)
            except RuntimeError:  # a parameter was resized (param.data = ...): a new layout next time
                buffers.restore_untouched()
                self._key = None

    def _restore_untouched(self) -> None:
        for r in self._replicas:
            r.restore_untouched()

    def reduce(self, variables: Sequence[Any], key: Any, mean: bool,
               reduction: InPlaceReduction | None = None) -> list[Any] | None:
        """Reduces every replica's gradients of the variables in the buffers, out of
        ``variables`` (all the registered ones), and returns the others, for the general
        path. None, when they cannot be: then the gradients are as autograd left them
        (slots it never wrote are None again) and all take the general path. With a
        ``reduction``, the buffers join it instead of being reduced here."""
        replicas = self._replicas
        if not replicas:
            return None
        if key != self._key:  # not every registered variable (opt.step() without backward), or new ones
            self._restore_untouched()
            return None
        with torch._C.DisableTorchFunctionSubclass():
            per_replica = [grads_of(r.components) for r in replicas]
            in_slots = all(r.in_slots(grads) for r, grads in zip(replicas, per_replica))
            if not in_slots and not self._into_slots(per_replica):
                self._restore_untouched()
                return None
            # a slot no replica's autograd wrote since it was zeroed is a gradient never produced
            never_written: set[int] | None = None
            for r in replicas:
                unwritten = r.never_written()
                never_written = unwritten if never_written is None else never_written & unwritten
                r.untouched = []
            self._reduce_flats(mean, reduction)
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
            if not all(g is None or g is a or fits(g, a) for g, a in zip(grads, r.aliases)):
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

    def _reduce_flats(self, mean: bool, reduction: InPlaceReduction | None = None) -> None:
        """Replica 0's buffers become the sum (the mean) of all replicas', copied into the
        others' (here, or as part of ``reduction``)."""
        replicas = self._replicas
        local = reduction if reduction is not None else InPlaceReduction(self._num_replicas, mean)
        for dtype in replicas[0].flats:
            local.add([r.flats[dtype] for r in replicas])
        if reduction is None:
            local.run()
