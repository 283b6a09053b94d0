"""Bucket transports: how a gradient synchroniser's buckets travel between the workers.

A gradient synchroniser (``_gradient_sync/bucketed/buckets.py``) owns registration, layout, the
order buckets fill in, and handing gradients out; it drives one :class:`BucketTransport`
through five calls, the same for every way of moving bytes:

1. ``plan(buckets)``, when the buckets are (re)built: the transport may move each
   bucket's flat buffer somewhere of its own (a shared-memory file) and returns the
   transport that carries them from now on (itself, or the one it falls back to);
2. ``launch(bucket, divisor)``, when a bucket is ready: its ``flat`` holds this worker's
   gradients, already divided, then one "has a gradient" flag per parameter (a transport
   that ``reads_gradients`` gets the gradient tensors in ``bucket.grads`` instead, not yet
   divided; a bucket the transport marked ``undivided`` holds them undivided: the
   transport divides as it sums);
3. ``poll()``, from later gradients' hooks: start what can start now;
4. ``finish(buckets)``, when backward ends: wait for every launched bucket;
5. ``sums(bucket)``: where the bucket's reduced ``flat`` lives, handed out as
   ``hand_out`` says.

``overlaps_backward`` says whether buckets leave while backward runs (the synchroniser
then launches each as soon as it is complete and learns backward's order) or all at its
end. One final class per way: here those over the worker group, :class:`AllReduceBuckets`
(packed gloo or NCCL collectives), :class:`CompressedBuckets` and :class:`PowerSGDBuckets`;
in ``shared_buckets.py`` those through a host's shared memory, ``SharedMemoryBuckets``
(one host) and ``PipelinedHostBuckets`` (several hosts, each bucket's slices crossing hosts
during backward). A cross-worker transport names its own
(``CrossWorkerTransport.bucket_transport``).
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import typing
from typing import Any

import torch
import torch.distributed as dist

from unison._collectives.group.worker_control import WorkerControl
from unison._collectives.transport.compression import Compressor
from unison._collectives.transport.powersgd import PowerSGDReducer

__all__ = [
    "GradientBucket",
    "HandOut",
    "BucketTransport",
    "AllReduceBuckets",
    "CompressedBuckets",
    "PowerSGDBuckets",
    "DEFAULT_BUCKET_BYTES",
    "OPERATION",
]

DEFAULT_BUCKET_BYTES = 4 * 1024 * 1024

OPERATION = "gradient all-reduce"
"""How a failed bucket all-reduce is named in errors."""


class HandOut(enum.Enum):
    """How a transport's sums reach the gradients."""

    VIEWS = "views"  # the reduced flat is the bucket's own: each gradient becomes a view of it
    COPIES = "copies"  # the sums live in memory the workers share: copied into each gradient
    IN_PLACE = "in place"  # the transport reduced the gradient tensors themselves


@dataclasses.dataclass(eq=False)
class GradientBucket:
    """One bucket: its parameters, their gradients' views of ``flat``, and the synchroniser's record of it.

    What a transport keeps per bucket (a shared segment, a compressed copy) is its own,
    keyed by ``id(bucket)`` so it never keeps a dropped model's parameters alive (``plan``
    starts it afresh whenever the buckets are rebuilt).

    ``flat`` holds the gradients' elements, then one flag per parameter (1 where this worker
    has a gradient for it), summed with them: a parameter whose flags sum to zero got no
    gradient on any worker and keeps none.
    """

    params: list[torch.Tensor]
    views: list[torch.Tensor]  # one view of `flat` per parameter, in its shape: made once, reused every step
    flat: torch.Tensor  # this worker's gradients, then its flags (a transport may move it: plan)
    grads: list[torch.Tensor] = dataclasses.field(default_factory=list)  # reads_gradients: this step's gradients
    work: Any = None  # the launched collective (shared memory: "every worker wrote its slot")
    # Kept by the gradient synchroniser (one record per bucket, as DDP's reducer keeps):
    ready: int = 0  # this backward pass's gradients counted in so far
    plain: bool = False  # every parameter is a plain tensor (not a distributed variable)
    wants_slots: bool = False  # reduced when backward ends, the gradients may live in flat slots (many, plain)
    # Set by the transport's plan: memory of its own where the gradients may live (a slot of a
    # shared file), into which it writes the sums back (None again after ``leave_home``) ...
    home: torch.Tensor | None = None
    undivided: bool = False  # launch takes the flat undivided: the transport divides
    home_holders: int | None = None  # the home's storage holders when its views were first handed out
    slots: Any = None  # reduced when backward ends: the gradients' own flat buffer (``GradSlots``)
    in_slots_next: bool = False  # the last step's gradients could all live in `slots` (none sparse or missing)
    launched_from_slots: bool = False  # this step's gradients went to the flat from `slots`
    unwritten: tuple[int, ...] = ()  # from slots: the parameters whose slot autograd left unwritten this step
    # This step's pieces (start, end, gradient) of the range ``own_range`` gave, which the fill left
    # unwritten (the transport reads them from the gradients), not yet divided by own_divisor:
    own_parts: list[tuple[int, int, torch.Tensor]] | None = None
    own_divisor: int = 1
    _flags: list[tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=list)  # (flat, its flags)

    @property
    def size(self) -> int:
        """The gradients' elements in ``flat`` (the flags follow)."""
        return self.flat.numel() - len(self.params)

    @property
    def used(self) -> torch.Tensor:
        """This worker's flags: the tail of its ``flat`` (the views of the last two flats kept:
        a slice is a tensor op, and a bucket in halves alternates between two)."""
        flat = self.flat
        for known, flags in self._flags:
            if known is flat:
                return flags
        flags = flat[self.size:]
        self._flags = [*self._flags[-1:], (flat, flags)]
        return flags


class BucketTransport(abc.ABC):
    """Moves gradient buckets between the workers for a gradient synchroniser (abstract)."""

    @property
    @abc.abstractmethod
    def overlaps_backward(self) -> bool:
        """Whether buckets leave while backward runs (else every bucket goes when it ends)."""

    @property
    def hand_out(self) -> HandOut:
        """How the sums reach the gradients."""
        return HandOut.VIEWS

    @property
    def reads_gradients(self) -> bool:
        """Whether ``launch`` takes the gradient tensors themselves (``bucket.grads``), not a filled ``flat``."""
        return False

    @property
    def in_shared_memory(self) -> bool:
        """Whether the buckets live in files the workers of a host share (diagnostics)."""
        return False

    def default_bucket_bytes(self) -> int:
        """The bucket size used when the user asked for none."""
        return DEFAULT_BUCKET_BYTES

    def plan(self, buckets: list[GradientBucket]) -> BucketTransport:
        """Takes the freshly built buckets; returns the transport that carries them (this one here)."""
        return self

    @abc.abstractmethod
    def launch(self, bucket: GradientBucket, divisor: int) -> None:
        """Starts moving a ready bucket."""

    def leave_home(self, bucket: GradientBucket) -> None:
        """The bucket's gradients leave its ``home`` for good (something outside holds it): its
        ``flat`` and ``views`` become memory never handed out, ``home`` None. Only for a
        transport that gives homes."""
        raise NotImplementedError(f"{type(self).__name__} gives no bucket a home")

    def own_range(self, bucket: GradientBucket) -> tuple[int, int] | None:
        """The ``[start, end)`` of the bucket's gradients that this worker alone reads, from the
        gradients themselves, if the fill leaves it unwritten and hands the pieces over in
        ``own_parts`` (one host's homes: this worker's slice); None: fill all of it."""
        return None

    def poll(self) -> None:  # noqa: B027 - a no-op default that subclasses may override
        """Starts, without waiting, what can start now (called from later gradients' hooks)."""

    @abc.abstractmethod
    def finish(self, buckets: list[GradientBucket]) -> None:
        """Waits until every bucket's sums are final."""

    def sums(self, bucket: GradientBucket) -> torch.Tensor:
        """The bucket's reduced flat (gradients, then the flags' sums)."""
        return bucket.flat

    def sum_views(self, bucket: GradientBucket) -> list[torch.Tensor]:
        """Per parameter, a view of its reduced gradient in :meth:`sums` (in its shape)."""
        return bucket.views

    def used_sums(self, bucket: GradientBucket) -> list[float]:
        """The flags summed over the workers."""
        return self.sums(bucket)[bucket.size:].tolist()


@typing.final
class AllReduceBuckets(BucketTransport):
    """One asynchronous ``all_reduce`` of each bucket's flat over the group (gloo or NCCL)."""

    def __init__(self, control: WorkerControl):
        self._control = control

    @property
    def overlaps_backward(self) -> bool:
        return True

    def launch(self, bucket: GradientBucket, divisor: int) -> None:
        bucket.work = self._control.launch(OPERATION, dist.all_reduce, bucket.flat)

    def finish(self, buckets: list[GradientBucket]) -> None:
        for bucket in buckets:
            self._control.wait(bucket.work, OPERATION)


@typing.final
class CompressedBuckets(BucketTransport):
    """Each bucket travels in a half type (``compression.py``); exactly again if float16 overflowed."""

    def __init__(self, control: WorkerControl, compressor: Compressor):
        self._control = control
        self._compressor = compressor
        self._wires: dict[int, torch.Tensor] = {}  # id(bucket) -> what travels (flat in the half type), reused

    @property
    def overlaps_backward(self) -> bool:
        return True

    def plan(self, buckets: list[GradientBucket]) -> BucketTransport:
        self._wires = {}
        return self

    def launch(self, bucket: GradientBucket, divisor: int) -> None:
        flat, compressor = bucket.flat, self._compressor
        if not compressor.compresses(flat):
            bucket.work = self._control.launch(OPERATION, dist.all_reduce, flat)
            return
        wire = self._wires.get(id(bucket))
        if wire is None:
            wire = self._wires[id(bucket)] = torch.empty(flat.shape, dtype=compressor.wire_dtype, device=flat.device)
        bucket.work = self._control.launch(OPERATION, dist.all_reduce, compressor.to_wire(flat, out=wire))

    def finish(self, buckets: list[GradientBucket]) -> None:
        for bucket in buckets:
            self._control.wait(bucket.work, OPERATION)
            wire = self._wires.get(id(bucket))
            if wire is None or not self._compressor.compresses(bucket.flat):
                continue
            if self._compressor.overflowed(wire):  # every worker holds this very sum: all redo it
                self._control.call(OPERATION, dist.all_reduce, bucket.flat)  # flat still holds this worker's share
            else:
                bucket.flat.copy_(wire)


@typing.final
class PowerSGDBuckets(BucketTransport):
    """Every dense gradient of a step through PowerSGD when backward ends (``powersgd.py``).

    It reads the gradients themselves (low-rank factors travel, not the buckets) and
    reduces them in place; a parameter without a gradient takes part as zeros.
    """

    def __init__(self, reducer: PowerSGDReducer):
        self._reducer = reducer
        self._pending: list[torch.Tensor] = []
        self._divisor = 1

    @property
    def overlaps_backward(self) -> bool:
        return False

    @property
    def hand_out(self) -> HandOut:
        return HandOut.IN_PLACE

    @property
    def reads_gradients(self) -> bool:
        return True

    def launch(self, bucket: GradientBucket, divisor: int) -> None:
        self._pending += bucket.grads  # reduced with the others in finish: PowerSGD spans the whole step
        self._divisor = divisor
        bucket.grads = []

    def finish(self, buckets: list[GradientBucket]) -> None:
        grads, self._pending = self._pending, []
        if grads:
            self._reducer.reduce(grads, self._divisor)  # its collectives name a lost task themselves
