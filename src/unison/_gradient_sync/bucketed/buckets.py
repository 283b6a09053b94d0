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
workers' mean everywhere. A sparse gradient (``nn.Embedding(sparse=True)``) keeps its
slot empty and flags -1: once the buckets are reduced, every worker whose flags' sum for
it is below zero -- also one that computed no gradient for it this step -- joins its
sparse all-reduce, in bucket order, so the workers make the same calls.

How a bucket travels is its transport's (``_collectives/transport/bucket_transports.py``:
over the group, compressed, PowerSGD; ``shared_buckets.py``: one host's shared memory, or
slices across hosts):
this class fills buckets, launches them through that contract and hands the sums out.
Where every bucket is reduced when backward ends (shared memory, PowerSGD) only a
backward pass's first gradient has work to do (its hook remembers the autograd graph
task; the others return at once). Where the sums are copied out of shared memory (one host's, or
slices across hosts), a bucket of more than 16 gradients that were all dense lives, from
the second step on, in flat slots of its own (``_gradient_sync/grads_as_buffer_views.py``):
a backward pass's first gradient points the others at them, autograd accumulates into
them, and the bucket reaches the shared file and back in one pass each; few (large)
gradients go straight into the file. Where the transport gives a bucket a ``home`` (this
worker's part of the file, where the sums come back), the slots are that memory, so many small
gradients pass neither in nor out, and a few large ones are handed out as views of it;
a gradient the user keeps makes the bucket leave its home (``leave_home``).
"""

from __future__ import annotations

import contextlib
import typing
import weakref
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from unison._collectives.group.worker_control import WorkerControl
from unison._collectives.transport.bucket_transports import (
    DEFAULT_BUCKET_BYTES,
    BucketTransport,
    GradientBucket,
    HandOut,
)
from unison._collectives.transport.cross_worker import CrossWorkerTransport
from unison._collectives.transport.flat_buffers import views_of
from unison._collectives.transport.packing import group_by_size
from unison._gradient_sync.bucketed.bucket_gradients import (
    as_divisor,
    copy_sums_out,
    fill_around,
    fill_from_slots,
    hand_out_views,
    home_held_elsewhere,
    point_grads_at_slots,
    set_flags,
)
from unison._gradient_sync.grad_access import grads_of
from unison._gradient_sync.grads_as_buffer_views import fits
from unison._gradient_sync.waiting_parameters import DormantParameters, LateParameters
from unison._interpose.torch_private import current_graph_task_id, queue_end_of_backward
from unison._reduce import ReduceOp
from unison.errors import GradientSyncError

__all__ = ["BucketedGradientSync", "DEFAULT_BUCKET_BYTES"]

# Up to this many gradients a bucket divides each into place (MEAN); above it, a bucket of
# dense gradients gets flat slots of its own on the shared-memory path.
_FUSED_DIVIDE_MAX_PARAMS = 16
_PER_GRADIENT_FILL_MIN_BYTES = 1 << 20
"""From this size a bucket of few gradients is filled gradient by gradient (each divided straight into
its slot, or around the range its owner reads from the gradients): a pass over the bytes saved is worth
a call per gradient. A smaller bucket is one foreach copy and one division: the calls cost more than
the bytes there (the hybrid DLRM's 110 KB bucket of 10 gradients took 0.36 ms a step filled around its
owner's range inside the job; ``benchmarks/RESULTS.md``)."""
_OPERATION = "gradient all-reduce"
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


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
        sparse_all_reduce: ``(gradient or None, parameter)`` -> the sparse gradient summed over
            the workers (by all-gather; None where no worker had one), called with None by a
            worker that computed none. Sparse gradients (``nn.Embedding(sparse=True)``) keep
            their slot in the bucket empty and are summed when the buckets are reduced, on
            every worker whose flags say some worker has one, in bucket order.
    """

    def __init__(self, control: WorkerControl, transport: CrossWorkerTransport, bucket_bytes: int,
                 reduce_op: Callable[[], ReduceOp],
                 sparse_all_reduce: Callable[[torch.Tensor | None, torch.Tensor], torch.Tensor | None]):
        self._control = control
        self._chosen = transport.bucket_transport()  # the way this group moves buckets
        self._transport: BucketTransport = self._chosen  # what carries the current buckets (see finalize)
        self._sparse_all_reduce = sparse_all_reduce
        self._sparse: set[int] = set()  # this step's: ids of parameters whose gradient is sparse here
        self._bucket_bytes = bucket_bytes  # <= 0: the default for the transport (see finalize)
        self._overlap_bytes: int | None = None  # see overlap_bucket_bytes
        self._reduce_op = reduce_op
        # Registered parameters, held weakly: a model the program dropped must not live on
        # (nor be all-reduced every step) because it was once built in scope. The buckets
        # hold their parameters strongly until finalize() rebuilds them (see _agreed_alive).
        self._params: list[weakref.ref[torch.Tensor]] = []
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
        self._buckets: list[GradientBucket] = []
        self._bucket_of: dict[int, int] = {}
        self._next = 0
        self._fired = False
        self._enabled = True
        # A transport that reduces every bucket when backward ends: only a backward pass's
        # first gradient has something to do, and where the sums are copied out (shared
        # memory) the gradients live in flat buffers of their own (GradSlots) that reach
        # the transport's flat in one pass.
        self._at_end = False
        self._in_slots = False  # the sums are copied out (shared memory): gradients may live in the buckets' slots
        self._settled_task = -1  # the autograd graph task whose first gradient was seen (that mode)

    @property
    def overlap_bucket_bytes(self) -> int | None:
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
        return [self._transport.in_shared_memory] * len(self._buckets)

    @property
    def bucket_transport(self) -> BucketTransport:
        """What carries the buckets now (for tests and diagnostics)."""
        return self._transport

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
        bucket_bytes = self._bucket_bytes if self._bucket_bytes > 0 else self._chosen.default_bucket_bytes()
        buckets: list[GradientBucket] = []
        for params in by_kind.values():
            for group in group_by_size([p.detach() for p in params], bucket_bytes):
                members = [params[i] for i in group]
                size = sum(p.numel() for p in members)  # then one "has a gradient" flag per parameter
                flat = torch.zeros(size + len(members), dtype=members[0].dtype, device=members[0].device)
                for p in members:
                    self._bucket_of[id(p)] = len(buckets)
                plain = all(type(p) in _PLAIN_TYPES for p in members)
                buckets.append(GradientBucket(members, views_of(flat[:size], members), flat, plain=plain,
                                              wants_slots=plain and len(members) > _FUSED_DIVIDE_MAX_PARAMS))
        self._buckets = buckets
        transport = self._transport = self._chosen.plan(buckets)
        # Learn backward's order where buckets leave during backward (gloo, across hosts);
        # one host's shared memory and PowerSGD reduce everything at its end.
        overlaps = transport.overlaps_backward
        self._overlap_bytes = bucket_bytes if overlaps else None
        self._observed = [] if self._order is None and overlaps else None
        self._at_end = not overlaps
        self._in_slots = transport.hand_out is HandOut.COPIES

    @property
    def crosses_hosts_during_backward(self) -> bool:
        """Whether buckets start across hosts while backward runs (tests and diagnostics)."""
        return self._transport.overlaps_backward and self._transport.hand_out is HandOut.COPIES

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
        if self._settled_task == current_graph_task_id() != -1:
            return  # reduced when backward ends: this backward pass's first gradient did the work
        if not self._enabled:
            return
        index = self._bucket_of.get(id(param))
        if index is None:
            return
        if self._at_end:
            self._settled_task = current_graph_task_id()
            if not self._fired:
                self._fired = True
                queue_end_of_backward(self._finish)
                point_grads_at_slots(self._buckets, self._transport.leave_home)
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
            queue_end_of_backward(self._finish)
            if self._in_slots:
                point_grads_at_slots(self._buckets, self._transport.leave_home)
        if param.grad is not None and param.grad.layout != torch.strided:
            self._sparse.add(id(param))  # summed when the buckets are (_sum_sparse_gradients)
        bucket.ready += 1
        while (self._next < len(self._buckets)
               and self._buckets[self._next].ready == len(self._buckets[self._next].params)):
            self._launch(self._buckets[self._next])
            self._next += 1
        self._transport.poll()

    def _sum_sparse_gradients(self, sparse_elsewhere: list[torch.Tensor]) -> None:
        """Sums the step's sparse gradients over the workers once the buckets are reduced: this
        worker's own and those only peers computed (``sparse_elsewhere``: the flags' sums told),
        in bucket order, so every worker makes the same calls; divided for MEAN."""
        if not self._sparse and not sparse_elsewhere:
            return
        joining = {id(p) for p in sparse_elsewhere}
        divisor = self._control.world_size if self._reduce_op() is ReduceOp.MEAN else 1
        for bucket in self._buckets:
            for param in bucket.params:
                if id(param) in self._sparse:
                    grad = param.grad
                elif id(param) in joining:
                    grad = None  # none here: this worker joins with no entries
                else:
                    continue
                reduced = self._sparse_all_reduce(grad, param)
                if reduced is not None:
                    param.grad = reduced / divisor if divisor != 1 else reduced

    def _launch(self, bucket: GradientBucket) -> None:
        """Fills a ready bucket with this worker's gradients (divided for MEAN, unless the transport
        divides: ``undivided``) and flags, and launches it."""
        divisor = self._control.world_size if self._reduce_op() is ReduceOp.MEAN else 1
        transport = self._transport
        if transport.reads_gradients:
            self._gather_gradients(bucket)
        else:
            if home_held_elsewhere(bucket):  # a gradient handed out as a view of it was kept
                transport.leave_home(bucket)
            share = 1 if bucket.undivided else divisor  # else the transport divides as it sums
            if not (self._in_slots and fill_from_slots(bucket, share)):
                self._fill(bucket, share, transport.own_range(bucket))
        transport.launch(bucket, divisor)

    def _fill(self, bucket: GradientBucket, divisor: int, own: tuple[int, int] | None = None) -> None:
        """Copies (dividing) each gradient into its view of the bucket's flat, and sets the flags;
        around ``own``, the range the transport reads from the gradients themselves, where it can."""
        flat = bucket.flat
        large = flat.numel() * flat.element_size() >= _PER_GRADIENT_FILL_MIN_BYTES
        if own is not None and large and fill_around(bucket, divisor, own, self._sparse):
            if self._in_slots:
                bucket.in_slots_next = False  # few large gradients: see below
            return
        # Few, large gradients (MEAN): divide each straight into its slot, one pass over the
        # bytes instead of a copy and then a division of the whole bucket. Many or small ones:
        # one foreach copy, since a Python-level op per gradient costs more than the
        # all-reduce it feeds.
        fused = divisor != 1 and large and len(bucket.params) <= _FUSED_DIVIDE_MAX_PARAMS
        targets, sources = [], []
        at_end = self._at_end
        missing = []  # parameters without a dense gradient here
        sparse = []  # parameters whose gradient is sparse here: summed apart
        for k, (param, view) in enumerate(zip(bucket.params, bucket.views)):
            grad = param.grad
            # where buckets leave during backward every hook recorded its sparse gradient; at the
            # end only a backward's first gradient had a hook call: the layout tells
            if id(param) in self._sparse or (at_end and grad is not None and grad.layout != torch.strided):
                self._sparse.add(id(param))
                view.zero_()
                sparse.append(k)
            elif grad is None:
                view.zero_()
                missing.append(k)
            elif grad.data_ptr() == view.data_ptr():
                if fused:
                    view.div_(as_divisor(divisor))
            elif fused:
                torch.div(grad, as_divisor(divisor), out=view)
            else:
                targets.append(view)
                sources.append(grad)
        if targets:
            torch._foreach_copy_(targets, sources)
        set_flags(bucket.used, missing, sparse)
        if divisor != 1 and not fused:
            flat.div_(as_divisor(divisor))
        if self._in_slots:
            # Few gradients are divided straight into the flat (one pass each); slots would
            # add a pass (zeroing, and autograd adding where it took the tensor over)
            bucket.in_slots_next = bucket.wants_slots and all(
                g is not None and fits(g, v) for g, v in zip(grads_of(bucket.params), bucket.views))

    def _gather_gradients(self, bucket: GradientBucket) -> None:
        """For a transport that reduces the gradients themselves: every dense gradient (zeros
        for a trainable parameter without one here; sparse ones are summed now)."""
        grads = []
        for param in bucket.params:
            grad = param.grad
            if id(param) in self._sparse or (grad is not None and grad.layout != torch.strided):
                self._sparse.add(id(param))  # summed after the buckets, in bucket order, as by every worker
                continue
            if grad is None:
                if not param.requires_grad:
                    continue  # frozen: no worker computed one, and the optimizer must skip it
                param.grad = grad = torch.zeros_like(param)
            grads.append(grad)
        bucket.grads = grads

    def _finish(self) -> None:
        """Launches what is left, waits for every bucket, and hands out the reduced gradients."""
        if not self._fired:
            return
        while self._next < len(self._buckets):
            self._launch(self._buckets[self._next])
            self._next += 1
        try:
            self._sum_sparse_gradients(self._reduce_buckets())
        finally:
            for bucket in self._buckets:
                bucket.work, bucket.ready, bucket.launched_from_slots, bucket.own_parts = None, 0, False, None
            self._next, self._fired = 0, False
            self._sparse.clear()  # this step's: a gradient sparse once may be dense the next step
        if self._observed:
            self._follow_gradient_order()
        if self._dormant or self._late:
            self._wake_dormant()
            self._woke_in_backward = True

    def _wake_dormant(self, check_late: bool = True) -> None:
        """Parameters made frozen that are trainable now, and late ones used now: this
        step's gradients are all-reduced one by one (zeros where this worker has none; a
        sparse one, on some worker, by the sparse sum on all), and from the next step on
        they are in the buckets. A collective: every worker unfreezes (or copies) the same
        parameters at the same step, as the same program does."""
        woken = self._dormant.take_trainable() if self._dormant else []
        # Only a worker that has a gradient for one asks its peers: an EMA copy, never
        # differentiated, costs no collective. (Used on some workers only at its first use,
        # it fails the step like any collective the workers do not all make.)
        if self._late and check_late and self._late.any_used_here():
            woken += self._late.take_used(lambda flags: self._control.agree_min_each(flags, "late parameters"))
        if not woken:
            return
        divisor = self._control.world_size if self._reduce_op() is ReduceOp.MEAN else 1
        # Which are sparse on some worker: one without a gradient cannot tell, and must join the
        # same sum (one small agreement, at a wake only)
        dense_here = [int(p.grad is None or p.grad.layout == torch.strided) for p in woken]
        agreed = self._control.agree_min_each(dense_here, "woken sparse gradients")
        for param, dense_everywhere in zip(woken, agreed):
            self._enroll(param)
            grad = param.grad
            if not dense_everywhere:
                if grad is not None and grad.layout == torch.strided:
                    grad = grad.to_sparse(1)  # sparse elsewhere: this worker's rows join the sum
                reduced = self._sparse_all_reduce(grad, param)
                if reduced is not None:
                    param.grad = reduced / divisor if divisor != 1 else reduced
                continue
            if grad is None:  # none here this step: the peers' mean still applies, as in the buckets
                grad = torch.zeros_like(param.detach())
            self._control.call(_OPERATION, dist.all_reduce, grad)
            if divisor != 1:
                grad.div_(divisor)
            param.grad = grad
        self.finalize()

    def _reduce_buckets(self) -> list[torch.Tensor]:
        """Waits for every launched bucket and hands out (or copies out) the reduced gradients;
        returns the parameters without a gradient here that some worker has a sparse one for."""
        transport = self._transport
        transport.finish(self._buckets)
        hand_out = transport.hand_out
        sparse_elsewhere: list[torch.Tensor] = []
        if hand_out is HandOut.VIEWS:
            for bucket in self._buckets:
                sparse_elsewhere += hand_out_views(bucket, transport, self._sparse)
        elif hand_out is HandOut.COPIES:
            for bucket in self._buckets:
                sparse_elsewhere += copy_sums_out(bucket, transport, self._sparse)
        return sparse_elsewhere

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
