"""Gradient all-reduce overlapped with backward, for one replica per worker.

The mechanism of DDP and Horovod: parameters are grouped into buckets in reverse
registration order (the order backward produces their gradients when modules were made
in forward order) and, after the first synchronised step, in the order backward did
produce them (worker 0's, as DDP rebuilds its buckets once); a hook after each
parameter's gradient accumulation counts it in, and when a bucket is complete (and all
buckets before it were launched, so every worker issues collectives in one order) its
gradients are copied into one flat buffer and an asynchronous ``all_reduce`` starts
while backward goes on. When the backward pass ends (an autograd engine callback, as
in DDP) the buckets not yet launched go too — zeros for parameters that got no
gradient this step, so no worker waits for one that never comes — and each parameter
gets a view of the reduced buffer as its gradient, before any code after backward()
(gradient clipping, AMP unscaling) reads it. Each bucket carries one flag per parameter
after its gradients (1 where this worker has one), summed with them: a parameter no
worker computed a gradient for (a frozen layer, a head this step skipped) keeps none, as
on one device and under DDP's ``find_unused_parameters``, so an optimizer skips it
(AdamW's decay and moments would move it); one that some worker computed gets the
workers' mean everywhere.

When every worker is on this host (gloo, ``implementation=AUTO``), each bucket's buffer
is this worker's slot of a shared-memory file instead (``shared_memory.py``). There is
nothing to overlap then (no transfer runs beside backward), so only a backward pass's
first gradient has work to do (its hook remembers the autograd graph task; the others
return at once); when it ends, each worker writes every gradient into its slots, says so
through a counter in the shared file, sums its slice of every bucket, and, once every
worker has, copies the sums back into its gradients. Memory speed instead of gloo's
loopback TCP, and the same sums as gloo's (gradients are divided before they are added).
From the second step on, a bucket of more than 16 gradients that were all dense lives in
flat slots of its own (``grad_slots.py``): the first gradient points the others at them,
autograd accumulates into them, and the bucket goes to the shared file and back in one
pass each, instead of a copy per gradient each way. A bucket of few (large) gradients
divides each straight into the shared file instead: slots would add a pass over its
bytes (``benchmarks/RESULTS.md``, 'Shared-memory slots per bucket').

When the workers span hosts with equally many workers each (the hierarchical transport's
columns), there is a transfer to overlap again: each bucket is written into its slot as
soon as it is complete, and as soon as every worker of the host wrote it (a look at the
shared counters from a later gradient's hook, never a wait) this worker sums its slice
and starts that slice's all-reduce across hosts, while backward goes on. Buckets are then
2 MB by default, so that a model's first buckets leave early. This gains where the link
between hosts is the bottleneck, and nothing where the workers and gloo's threads
compete for the same cores (``benchmarks/RESULTS.md``, 'Pipelined buckets across hosts').
"""

from __future__ import annotations

import contextlib
import dataclasses
import typing
import weakref
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from unison.collectives.compression import Compressor
from unison.collectives.flat_buffers import views_of
from unison.collectives.packing import group_by_size
from unison.collectives.powersgd import PowerSGDReducer
from unison.collectives.shared_memory import SharedMemoryAllReduce, SharedSegment
from unison.collectives.transports import BucketSharing, CrossWorkerTransport, HierarchicalTransport
from unison.collectives.worker_control import WorkerControl
from unison.errors import GradientSyncError
from unison.gradient_sync.dormant import DormantParameters, LateParameters
from unison.gradient_sync.grad_access import grads_of
from unison.gradient_sync.grad_slots import GradSlots, fits
from unison.reduce import ReduceOp

__all__ = ["BucketedGradientSync", "DEFAULT_BUCKET_BYTES"]

DEFAULT_BUCKET_BYTES = 4 * 1024 * 1024
PIPELINED_BUCKET_BYTES = 2 * 1024 * 1024
"""Default bucket size when buckets cross hosts one by one during backward.

Small enough that a model's first buckets leave early, large enough to keep the
collectives few (``benchmarks/RESULTS.md``, 'Pipelined buckets across hosts')."""
# Up to this many gradients a bucket divides each into place (MEAN); above it, a bucket of
# dense gradients gets flat slots of its own on the shared-memory path.
_FUSED_DIVIDE_MAX_PARAMS = 16
_OPERATION = "gradient all-reduce"


@dataclasses.dataclass
class _Bucket:
    params: list[torch.Tensor]
    views: list[torch.Tensor]  # one view of `flat` per parameter, in its shape: made once, reused every step
    flat: torch.Tensor  # with a segment: this worker's input slot of it
    ready: int = 0
    work: Any = None
    segment: SharedSegment | None = None  # shared memory: `work` then only says every worker wrote its slot
    results: list[torch.Tensor] = dataclasses.field(default_factory=list)  # per parameter, views of segment.result
    across: list[Any] = dataclasses.field(default_factory=list)  # pipelined: the works adding it across hosts
    wire: torch.Tensor | None = None  # with compression: what travels (flat in the half type), reused
    written: torch.Tensor = dataclasses.field(default_factory=lambda: torch.zeros(1, dtype=torch.int32))
    plain: bool = False  # every parameter is a plain tensor (not a distributed variable)
    slots: GradSlots | None = None  # one host's shared memory: the gradients' own flat buffer
    in_slots_next: bool = False  # the last step's gradients could all live in `slots` (none sparse or missing)
    launched_from_slots: bool = False  # this step's gradients went to the shared file from `slots`
    unwritten: tuple[int, ...] = ()  # from slots: the parameters whose slot autograd left unwritten this step

    # After the gradients, `flat` holds one flag per parameter: 1 where this worker has a
    # gradient for it (before the division for MEAN). Summed with the gradients, they say
    # which parameters no worker computed one for; those keep no gradient (see used_sums).
    @property
    def size(self) -> int:
        """The gradients' elements in ``flat`` (the flags follow)."""
        return self.flat.numel() - len(self.params)

    @property
    def used(self) -> torch.Tensor:
        """This worker's flags: the tail of its ``flat``."""
        return self.flat[self.size:]

    def used_sums(self) -> list[float]:
        """The flags summed over the workers (in the reduced ``flat`` or the shared result)."""
        reduced = self.segment.result if self.segment is not None else self.flat
        return reduced[self.size:].tolist()


_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
_current_graph_task_id = torch._C._current_graph_task_id


def _set_flags(used: torch.Tensor, missing: "list[int] | tuple[int, ...]") -> None:
    """This worker's flags: 1 for each parameter of the bucket, 0 for those in ``missing``."""
    used.fill_(1)
    if missing:
        used[list(missing)] = 0


@typing.final
class BucketedGradientSync:
    """All-reduces gradients of registered parameters from autograd hooks.

    Args:
        control: the worker group's plumbing (waits, lost-peer errors), shared with the
            strategy's batch reductions.
        transport: the cross-worker transport the strategy chose; the buckets live in
            its shared memory when it has one.
        bucket_bytes: target bucket size in bytes (``<= 0``: DEFAULT_BUCKET_BYTES).
        reduce_op: returns the current gradient ReduceOp (MEAN or SUM).
        sparse_all_reduce: sums a sparse gradient over workers (by all-gather); sparse
            gradients (``nn.Embedding(sparse=True)``) are reduced in their hook, in the
            same order on every worker, and keep their slot in the bucket empty.
    """

    def __init__(self, control: WorkerControl, transport: CrossWorkerTransport, bucket_bytes: int,
                 reduce_op: Callable[[], ReduceOp], sparse_all_reduce: Callable[[torch.Tensor], torch.Tensor]):
        self._control = control
        self._cross_worker = transport
        self._transport: SharedMemoryAllReduce | None = None
        self._sharing: BucketSharing | None = None
        self._compressor: Compressor | None = getattr(transport, "compressor", None)
        self._powersgd: PowerSGDReducer | None = getattr(transport, "powersgd", None)
        self._sparse_all_reduce = sparse_all_reduce
        self._sparse: set[int] = set()
        self._bucket_bytes = bucket_bytes  # <= 0: the default for the transport (see finalize)
        self._pipeline: HierarchicalTransport | None = None  # buckets cross hosts during backward
        self._started = 0  # pipelined: buckets whose trip across hosts has started, this backward
        self.started_during_backward = 0
        self._overlap_bytes: int | None = None  # see overlap_bucket_bytes
        """Pipelined: how many buckets of the last backward pass started across hosts before it ended (diagnostics)."""
        self._reduce_op = reduce_op
        # Registered parameters, held weakly: a model the program dropped must not live on
        # (nor be all-reduced every step) because it was once built in scope. The buckets
        # hold their parameters strongly until finalize() rebuilds them (see _agreed_alive).
        self._params: list["weakref.ref[torch.Tensor]"] = []
        self._index_of: dict[int, int] = {}  # id(param) -> its place in self._params
        self._dormant = DormantParameters()  # made frozen: registered once trainable
        self._late = LateParameters()  # registered after the buckets were built: bucketed once used
        self._built = False  # whether finalize() has built the buckets
        self._woke_in_backward = False  # the end of this step's backward checked _dormant and _late
        # Bucket order: parameters by their place in self._params, in the order backward
        # produced their gradients in the first synchronised step (None until then: reversed
        # registration order). _observed records that step's order.
        self._order: list[int] | None = None
        self._observed: list[int] | None = None
        self._buckets: list[_Bucket] = []
        self._bucket_of: dict[int, int] = {}
        self._next = 0
        self._fired = False
        self._enabled = True
        # One host's shared memory: every bucket is reduced when backward ends, so only a
        # backward pass's first gradient has something to do, and the gradients live in
        # flat buffers of their own (GradSlots) that reach the shared file in one pass.
        self._reduces_at_end_in_memory = False
        self._settled_task = -1  # the autograd graph task whose first gradient was seen (that mode)

    @property
    def overlap_bucket_bytes(self) -> "int | None":
        """The bucket size, where buckets leave while backward runs (gloo, across hosts);
        None where every bucket is reduced when backward ends, or before the buckets exist.
        A compiled backward split at this size lets them leave during it (``compile_backend``)."""
        return self._overlap_bytes

    @property
    def parameters_in_buckets(self) -> int:
        """How many parameters the buckets hold (for tests and diagnostics)."""
        return sum(len(bucket.params) for bucket in self._buckets)

    @property
    def buckets_in_shared_memory(self) -> list[bool]:
        """For each bucket, whether it lives in shared memory (for tests and diagnostics)."""
        return [bucket.segment is not None for bucket in self._buckets]

    def register(self, param: torch.Tensor) -> None:
        """Adds a parameter; its hook is installed and buckets rebuilt by :meth:`finalize`.

        A parameter made frozen (``nn.Parameter(t, requires_grad=False)``) waits aside
        until it is trainable (see ``_wake_dormant``): in the buckets it would cost an
        all-reduce of zeros every step, and left out for good, the workers drifted apart
        once it was unfrozen. One registered after the buckets were built waits until a
        backward gives it a gradient on some worker (``LateParameters``).
        """
        if not param.requires_grad:
            self._dormant.add(param)
            return
        if self._built:  # deep-copied or replaced after the scope: joins once used (see LateParameters)
            self._late.add(param)
            return
        self._enroll(param)

    def _enroll(self, param: torch.Tensor) -> None:
        """Puts ``param`` among the parameters the next :meth:`finalize` buckets."""
        self._index_of[id(param)] = len(self._params)
        self._params.append(weakref.ref(param))
        param.register_post_accumulate_grad_hook(self._on_grad)

    def _agreed_alive(self) -> list[torch.Tensor]:
        """The registered parameters still alive on every worker; the others are forgotten.

        A model built in scope and then dropped was otherwise kept alive by the buckets,
        and every later backward all-reduced its gradients as zeros, which can double a
        small step (``benchmarks/RESULTS.md``, 'Dropped models leave the buckets').
        Workers must agree, since the buckets' layout must match: a parameter
        any worker dropped (its garbage collector may run later elsewhere) leaves on all.
        """
        params = [ref() for ref in self._params]
        alive = self._control.agree_min_each([int(p is not None) for p in params], "gradient bucket layout")
        kept = [k for k, ok in enumerate(alive) if ok]
        if len(kept) == len(params):
            return typing.cast(list, params)
        new_index = {old: new for new, old in enumerate(kept)}
        if self._order is not None:
            self._order = [new_index[k] for k in self._order if k in new_index]
        survivors: list[torch.Tensor] = [params[k] for k in kept]  # type: ignore[misc]
        self._params = [weakref.ref(p) for p in survivors]
        self._index_of = {id(p): k for k, p in enumerate(survivors)}
        self._sparse &= set(self._index_of)
        return survivors

    def finalize(self) -> None:
        """(Re)builds the buckets over every registered parameter.

        A collective: every worker calls it at the same point (after the initial
        broadcast of variables, or after the first synchronised backward). Parameters the
        program dropped on any worker leave the buckets here.
        """
        self._buckets, self._bucket_of = [], {}  # the buckets' references must not keep a parameter alive
        self._built = True
        params = self._agreed_alive()
        if self._order is not None and len(self._order) != len(params):
            self._order = None  # parameters came since: learn the order again
        indices = self._order if self._order is not None else list(reversed(range(len(params))))
        order = [params[i] for i in indices]
        by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for param in order:
            by_kind.setdefault((param.dtype, param.device), []).append(param)
        sharing = self._cross_worker.bucket_sharing
        pipelines = isinstance(sharing, HierarchicalTransport) and sharing.slices_cross_hosts
        bucket_bytes = self._bucket_bytes
        if bucket_bytes <= 0:  # smaller buckets when they can leave during backward: more of the trip overlaps
            bucket_bytes = PIPELINED_BUCKET_BYTES if pipelines else DEFAULT_BUCKET_BYTES
        self._buckets, self._bucket_of = [], {}
        for params in by_kind.values():
            for group in group_by_size([p.detach() for p in params], bucket_bytes):
                members = [params[i] for i in group]
                size = sum(p.numel() for p in members)  # then one "has a gradient" flag per parameter
                flat = torch.zeros(size + len(members), dtype=members[0].dtype, device=members[0].device)
                views = views_of(flat[:size], members)
                for p in members:
                    self._bucket_of[id(p)] = len(self._buckets)
                self._buckets.append(_Bucket(members, views, flat, plain=all(type(p) in _PLAIN_TYPES for p in members)))
        self._share_buckets()
        self._pipeline = None
        if (pipelines and self._transport is not None and self._transport.signals is not None
                and self._compressor is None and self._powersgd is None):
            self._pipeline = typing.cast(HierarchicalTransport, sharing)
        # Learn backward's order where buckets leave during backward (gloo, across hosts);
        # one host's shared memory and PowerSGD reduce everything at its end.
        overlaps = self._powersgd is None and (self._sharing is None or self._pipeline is not None)
        self._overlap_bytes = bucket_bytes if overlaps else None
        self._observed = [] if self._order is None and overlaps else None
        self._reduces_at_end_in_memory = (self._sharing is not None and self._pipeline is None
                                          and self._compressor is None and self._powersgd is None)

    @property
    def crosses_hosts_during_backward(self) -> bool:
        """Whether buckets start across hosts while backward runs (for tests and diagnostics)."""
        return self._pipeline is not None

    def _share_buckets(self) -> None:
        """Moves every bucket into a shared-memory file when the workers can share one."""
        self._transport, self._sharing = None, None
        sharing = self._cross_worker.bucket_sharing
        transport = sharing.shared_memory if sharing is not None else None
        if (transport is None or not transport.available or not self._buckets
                or not all(b.flat.is_cpu for b in self._buckets)
                or any(b.flat.numel() == 0 for b in self._buckets)):
            return
        segments = []
        for bucket in self._buckets:
            segment = transport.new_segment(bucket.flat.dtype, bucket.flat.numel())
            if segment is None:
                return  # the workers cannot share memory: every bucket stays on gloo
            segments.append(segment)
        for bucket, segment in zip(self._buckets, segments):
            flat = transport.my_slot(segment)
            flat.zero_()
            size = bucket.size
            bucket.flat, bucket.views, bucket.segment = flat, views_of(flat[:size], bucket.params), segment
            bucket.results = views_of(segment.result[:size], bucket.params)
        self._transport, self._sharing = transport, sharing

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulates gradients locally: backward passes inside do not communicate."""
        previous, self._enabled = self._enabled, False
        try:
            yield
        finally:
            self._enabled = previous

    # -- hooks ------------------------------------------------------------------------
    def _on_grad(self, param: torch.Tensor) -> None:
        if self._settled_task == _current_graph_task_id() != -1:
            return  # one host's shared memory: this backward pass's first gradient did the work
        if not self._enabled:
            return
        index = self._bucket_of.get(id(param))
        if index is None:
            return
        if self._reduces_at_end_in_memory:
            self._settled_task = _current_graph_task_id()
            if not self._fired:
                self._fired = True
                torch.autograd.Variable._execution_engine.queue_callback(self._finish)
                self._point_grads_at_slots()
            return
        bucket = self._buckets[index]
        if self._observed is not None:
            self._observed.append(self._index_of[id(param)])
        if bucket.work is not None:
            raise GradientSyncError(
                "a parameter's gradient was computed twice in one backward pass after its all-reduce had "
                "started (a backward through part of the graph twice?); call backward once per step, and "
                "accumulate micro-batches with `with strategy.extended.no_sync():`"
            )
        if not self._fired:
            self._fired = True
            # Finish when this backward pass ends, as DDP does: code between backward() and
            # opt.step() (clip_grad_norm_, GradScaler.unscale_, logging) sees reduced gradients.
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        if param.grad is not None and param.grad.layout != torch.strided:
            self._reduce_sparse(param)
        if self._powersgd is not None or (self._sharing is not None and self._pipeline is None):
            return  # one host's shared memory, PowerSGD: every bucket is reduced when backward ends
        bucket.ready += 1
        while self._next < len(self._buckets) and self._buckets[self._next].ready == len(self._buckets[self._next].params):
            self._launch(self._buckets[self._next])
            self._next += 1
        if self._pipeline is not None:
            self._start_written_buckets()

    def _reduce_sparse(self, param: torch.Tensor) -> None:
        """Sums a sparse gradient over the workers now (all-gather); its bucket slot stays empty."""
        grad = param.grad
        assert grad is not None  # the callers saw a sparse gradient
        self._sparse.add(id(param))
        reduced = self._sparse_all_reduce(grad)
        param.grad = reduced / self._control.world_size if self._reduce_op() is ReduceOp.MEAN else reduced

    def _point_grads_at_slots(self) -> None:
        """At the first gradient of a backward pass (one host's shared memory): the gradients
        of each bucket whose last step's gradients could all live in flat slots are pointed at
        them, so autograd accumulates into them and the bucket reaches the shared file in one
        pass. Buckets with a sparse or a missing gradient last step keep their own tensors:
        a sparse gradient added into a dense slot would stop being sparse."""
        for bucket in self._buckets:
            if not bucket.in_slots_next:
                continue
            grads = grads_of(bucket.params)
            slots = bucket.slots
            if slots is not None and slots.in_slots(grads):
                slots.untouched = []  # zero_grad(set_to_none=False): every gradient is a tensor already
                continue  # accumulating into the slots already
            if slots is None or slots.held_elsewhere(grads):  # never overwrite a gradient someone kept
                slots = bucket.slots = GradSlots(bucket.params)
            try:
                # a slot autograd never writes is a gradient this worker did not compute (see unwritten)
                slots.point_grads(grads, track_unwritten=True)
            except RuntimeError:  # a parameter resized since (param.data = ...): its own tensors from now on
                bucket.slots, bucket.in_slots_next = None, False

    def _start_written_buckets(self) -> None:
        """Pipelined: every posted bucket that all of this host's workers have written too (a
        look at the shared counters, no wait) is summed in this worker's slice and starts
        across hosts, in bucket order (the same on every worker)."""
        assert self._pipeline is not None and self._transport is not None
        while self._started < self._next:
            bucket = self._buckets[self._started]
            if not bucket.work.is_completed():
                return
            self._start_across(bucket)

    def _start_across(self, bucket: _Bucket) -> None:
        assert self._pipeline is not None and self._transport is not None and bucket.segment is not None
        self._transport.sum_my_slice(bucket.segment)
        bucket.across = self._pipeline.start_across_hosts(bucket.segment)
        self._started += 1

    def _launch(self, bucket: _Bucket) -> None:
        flat = bucket.flat
        divisor = self._control.world_size if self._reduce_op() is ReduceOp.MEAN else 1
        if self._reduces_at_end_in_memory and self._launch_from_slots(bucket, divisor):
            return
        # Few, large gradients (MEAN): divide each straight into its slot, one pass over the
        # bytes instead of a copy and then a division of the whole bucket. Many small ones:
        # one foreach copy, since a Python-level op per gradient costs more than the
        # all-reduce it feeds.
        fused = divisor != 1 and len(bucket.params) <= _FUSED_DIVIDE_MAX_PARAMS
        targets, sources = [], []
        at_end = self._reduces_at_end_in_memory
        missing = []  # parameters without a dense gradient here
        for k, (param, view) in enumerate(zip(bucket.params, bucket.views)):
            grad = param.grad
            if at_end and grad is not None and grad.layout != torch.strided:
                self._reduce_sparse(param)  # not in its hook: only a backward's first gradient has one here
                view.zero_()
                missing.append(k)
            elif grad is None or id(param) in self._sparse:
                view.zero_()
                missing.append(k)
            elif grad.data_ptr() == view.data_ptr():
                if fused:
                    view.div_(divisor)
            elif fused:
                torch.div(grad, divisor, out=view)
            else:
                targets.append(view)
                sources.append(grad)
        if targets:
            torch._foreach_copy_(targets, sources)
        _set_flags(bucket.used, missing)
        if divisor != 1 and not fused:
            flat.div_(divisor)
        compressor = self._compressor
        if compressor is not None and compressor.compresses(flat):  # divided above: cast, and send the half
            if bucket.wire is None:
                bucket.wire = torch.empty(flat.shape, dtype=compressor.wire_dtype, device=flat.device)
            bucket.work = self._control.launch(_OPERATION, dist.all_reduce, compressor.to_wire(flat, out=bucket.wire))
        elif self._sharing is None:
            bucket.work = self._control.launch(_OPERATION, dist.all_reduce, flat)
        else:  # shared memory: only say that this worker's slot is written
            bucket.work = self._sharing.announce(bucket.written)

    def _launch_from_slots(self, bucket: _Bucket, divisor: int) -> bool:
        """Writes a bucket whose gradients all live in its slots into the shared file in one
        pass (divided for MEAN, as the per-gradient path divides); False otherwise, after
        noting whether they can from the next step on."""
        grads = grads_of(bucket.params)
        slots = bucket.slots
        bucket.launched_from_slots = slots is not None and slots.in_slots(grads)
        if slots is None or not bucket.launched_from_slots:
            # Few gradients are divided straight into the shared file (one pass each); slots
            # would add a pass (zeroing, and autograd adding where it took the tensor over)
            bucket.in_slots_next = len(bucket.params) > _FUSED_DIVIDE_MAX_PARAMS and bucket.plain and all(
                g is not None and fits(g, v) for g, v in zip(grads, bucket.views))
            return False
        (gradients,) = slots.flats.values()  # a bucket holds one dtype
        body = bucket.flat[:bucket.size]
        if divisor != 1:
            torch.div(gradients, divisor, out=body)
        else:
            body.copy_(gradients)
        bucket.unwritten = tuple(sorted(slots.never_written())) if slots.untouched else ()
        slots.untouched = []
        _set_flags(bucket.used, bucket.unwritten)
        assert self._sharing is not None
        bucket.work = self._sharing.announce(bucket.written)
        return True

    def _finish(self) -> None:
        """Launches what is left, waits for every bucket, and hands out the reduced gradients."""
        if not self._fired:
            return
        if self._powersgd is not None:
            self._finish_powersgd()
            if self._dormant or self._late:
                self._wake_dormant()
            return
        while self._next < len(self._buckets):
            self._launch(self._buckets[self._next])
            self._next += 1
        try:
            self._reduce_buckets()
        finally:
            for bucket in self._buckets:
                bucket.work, bucket.ready, bucket.across, bucket.launched_from_slots = None, 0, [], False
            self._next, self._started, self._fired = 0, 0, False
        if self._observed:
            self._follow_gradient_order()
        if self._dormant or self._late:
            self._wake_dormant()
            self._woke_in_backward = True

    def _wake_dormant(self, check_late: bool = True) -> None:
        """Parameters made frozen that are trainable now, and late ones used now: this
        step's gradients are all-reduced one by one (zeros where this worker has none),
        and from the next step on they are in the buckets. A collective: every worker
        unfreezes (or copies) the same parameters at the same step, as the same program does."""
        woken = self._dormant.take_trainable() if self._dormant else []
        # Only a worker that has a gradient for one asks its peers: an EMA copy, never
        # differentiated, costs no collective. (Used on some workers only at its first use,
        # it fails the step like any collective the workers do not all make.)
        if self._late and check_late and self._late.any_used_here():
            woken += self._late.take_used(lambda flags: self._control.agree_min_each(flags, "late parameters"))
        if not woken:
            return
        divisor = self._control.world_size if self._reduce_op() is ReduceOp.MEAN else 1
        for param in woken:
            self._enroll(param)
            grad = param.grad
            if grad is not None and grad.layout != torch.strided:
                reduced = self._sparse_all_reduce(grad)
                param.grad = reduced / divisor if divisor != 1 else reduced
                continue
            if grad is None:  # none here this step: the peers' mean still applies, as in the buckets
                grad = torch.zeros_like(param.detach())
            self._control.call(_OPERATION, dist.all_reduce, grad)
            if divisor != 1:
                grad.div_(divisor)
            param.grad = grad
        self.finalize()

    def _reduce_buckets(self) -> None:
        """Waits for every launched bucket and hands out (or copies out) the reduced gradients."""
        if self._pipeline is not None:
            self._finish_pipelined()
            return
        for bucket in self._buckets:
            self._control.wait(bucket.work, _OPERATION)
            if bucket.segment is None:
                if bucket.wire is not None:
                    self._from_wire(bucket)
                self._hand_out(bucket)
        if self._transport is not None and self._sharing is not None:
            shared = [(bucket, bucket.segment) for bucket in self._buckets if bucket.segment is not None]
            for _, segment in shared:
                self._transport.sum_my_slice(segment)
            self._sharing.complete([segment for _, segment in shared])
            for bucket, _ in shared:
                self._copy_sums_out(bucket)

    def _follow_gradient_order(self) -> None:
        """After the first synchronised backward: buckets follow the order its gradients came in.

        As DDP's bucket rebuild: buckets are first laid out in reverse registration order,
        which is backward's order only when modules were created in forward order; a bucket
        holding one gradient that comes late is launched late, and every bucket after it
        waits. Worker 0's observed order (parameters that got no gradient last, in the old
        order) is every worker's; the buckets are rebuilt once, when it differs.
        """
        observed, self._observed = self._observed or [], None
        seen = dict.fromkeys(observed)
        current = list(reversed(range(len(self._params))))  # finalize() left only live parameters
        proposal = list(seen) + [i for i in current if i not in seen]
        order = self._control.broadcast_ints(proposal, "gradient bucket order")
        self._order = order
        if order != current:
            self.finalize()  # a collective when the buckets live in shared memory: every worker is here

    def _finish_pipelined(self) -> None:
        """The buckets not yet on their way across hosts go (in order, once the host wrote
        them), then every trip is waited for and the sums are copied out."""
        assert self._pipeline is not None
        self.started_during_backward = self._started
        for bucket in self._buckets[self._started:]:
            self._control.wait(bucket.work, _OPERATION)
            self._start_across(bucket)
        self._pipeline.finish_across_hosts([work for bucket in self._buckets for work in bucket.across])
        for bucket in self._buckets:
            self._copy_sums_out(bucket)

    def _finish_powersgd(self) -> None:
        """Every dense gradient of the step through PowerSGD (a parameter without one: zeros)."""
        assert self._powersgd is not None
        try:
            grads = []
            for bucket in self._buckets:
                for param in bucket.params:
                    if id(param) in self._sparse:
                        continue
                    if param.grad is None:
                        if not param.requires_grad:
                            continue  # frozen: no worker computed one, and the optimizer must skip it
                        param.grad = torch.zeros_like(param)
                    grads.append(param.grad)
            divisor = self._control.world_size if self._reduce_op() is ReduceOp.MEAN else 1
            self._powersgd.reduce(grads, divisor)  # its collectives name a lost task themselves
        finally:
            self._fired = False

    def _from_wire(self, bucket: _Bucket) -> None:
        """A compressed bucket's sum back into its flat buffer, or the bucket again exactly if float16 overflowed."""
        assert self._compressor is not None and bucket.wire is not None
        if self._compressor.overflowed(bucket.wire):  # every worker holds this very sum: all redo it
            self._control.call(_OPERATION, dist.all_reduce, bucket.flat)  # flat still holds this worker's share
        else:
            bucket.flat.copy_(bucket.wire)

    def _copy_sums_out(self, bucket: _Bucket) -> None:
        """Copies a shared bucket's sums into the parameters' own gradients (one foreach copy).

        The shared result cannot become the gradient itself: a worker that zeroes its
        gradients in place (``zero_grad(set_to_none=False)``) would zero a peer's too.
        Gradients that live in the bucket's own slots take one copy.
        """
        if bucket.launched_from_slots:  # no user code ran since: the gradients are still the slots
            assert bucket.slots is not None and bucket.segment is not None
            (gradients,) = bucket.slots.flats.values()
            gradients.copy_(bucket.segment.result[:bucket.size])
            if bucket.unwritten:  # slots this worker left unwritten: None again where no worker wrote one
                everywhere = bucket.used_sums()
                for k in bucket.unwritten:
                    if everywhere[k] == 0:
                        bucket.params[k].grad = None
            return
        targets, sources = [], []
        sums: list[float] | None = None
        for k, (param, result) in enumerate(zip(bucket.params, bucket.results)):
            grad = param.grad
            if id(param) in self._sparse:
                continue
            if grad is None:
                if not param.requires_grad:
                    continue  # frozen: no worker computed one
                if sums is None:
                    sums = bucket.used_sums()
                if sums[k] != 0:  # else no worker computed one (a head this step skipped)
                    param.grad = result.clone()  # no gradient here this step; the peers' mean still applies
            elif grad.is_contiguous() and grad.layout == torch.strided:
                targets.append(grad)
                sources.append(result)
            else:
                param.grad = result.clone()
        if targets:
            torch._foreach_copy_(targets, sources)

    def _hand_out(self, bucket: _Bucket) -> None:
        sums: list[float] | None = None
        for k, (param, view) in enumerate(zip(bucket.params, bucket.views)):
            # still the view when zero_grad(set_to_none=False) kept it: setting .grad costs more
            grad = param.grad
            if grad is view or id(param) in self._sparse:
                continue
            if grad is None:
                if not param.requires_grad:
                    continue  # frozen: no worker computed one (and no look at the sums: on a GPU, a sync)
                if sums is None:
                    sums = bucket.used_sums()
                if sums[k] == 0:
                    continue  # no worker computed one (a head this step skipped): the optimizer skips it
            param.grad = view

    # -- optimizer step ---------------------------------------------------------------
    def pre_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        """Refuses a step inside no_sync(); gradients were reduced when backward ended."""
        if not self._enabled:
            raise GradientSyncError(
                "opt.step() inside `no_sync()`: the accumulated gradients were never all-reduced, so workers "
                "would diverge; leave no_sync() for the last micro-batch's backward, then step"
            )
        self._finish()  # normally a no-op: the end-of-backward callback already ran
        check_late = bool(self._late) and not self._woke_in_backward  # no bucketed parameter had a gradient
        if self._dormant or check_late:
            self._wake_dormant(check_late)
        self._woke_in_backward = False
        return None

    def post_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Nothing to do: gradients were synchronised before the step."""
