"""A second worker played in-process, for ``BucketedGradientSync`` in one process.

``PeerBuckets`` implements the bucket transport contract
(``_collectives/transport/bucket_transports.py``) the way a real one behaves for worker 0
of two: what this worker launched plus the peer's known share (its gradient divided as
the synchroniser divides, then its flags), the sums where the transport says they are
(the bucket's own flat for ``VIEWS``, a tensor of the transport's for ``COPIES``, the
gradients themselves for ``IN_PLACE``). A way with ``homes`` gives each bucket a ``home``
(its flat, standing for this worker's part of a shared file) and writes the sums back into
it, as one host's shared memory does; a bucket that wants slots is taken there undivided
(the transport divides); one that leaves its home gets a spare flat. The sum is formed at
``finish`` from a copy taken at ``launch``, as a collective reads the flat once launched.
``PeerControl`` answers the worker group's calls the synchroniser makes (agreement on the
layout and on late parameters, worker 0's bucket order, the one-by-one all-reduce of a
parameter that joins late) with the peer's values. The peer's gradients come from plain autograd on its own
batch, so a test's expected gradient is ``(mine + peer's) / 2``.
"""

from __future__ import annotations

import dataclasses
import typing
import weakref
from collections.abc import Callable, Iterable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from unison._collectives.transport.bucket_transports import BucketTransport, GradientBucket, HandOut
from unison._collectives.transport.flat_buffers import views_of
from unison._gradient_sync.bucketed import BucketedGradientSync
from unison._reduce import ReduceOp

WORLD = 2


@dataclasses.dataclass(frozen=True)
class Way:
    """How a real bucket transport behaves, as far as the synchroniser can tell."""

    name: str
    overlaps_backward: bool
    hand_out: HandOut
    reads_gradients: bool = False
    homes: bool = False

    def __str__(self) -> str:
        return self.name


ALL_REDUCE = Way("all_reduce", True, HandOut.VIEWS)  # AllReduceBuckets, CompressedBuckets
SHARED_MEMORY = Way("shared_memory", False, HandOut.COPIES)  # SharedMemoryBuckets on several hosts
SHARED_HOMES = Way("shared_homes", False, HandOut.COPIES, homes=True)  # SharedMemoryBuckets on one host
ACROSS_HOSTS = Way("across_hosts", True, HandOut.COPIES)  # PipelinedHostBuckets on hosts of one worker
ACROSS_HOMES = Way("across_homes", True, HandOut.COPIES, homes=True)  # PipelinedHostBuckets, hosts of two or more
POWERSGD = Way("powersgd", False, HandOut.IN_PLACE, reads_gradients=True)  # PowerSGDBuckets (exact here)
WAYS = [ALL_REDUCE, SHARED_MEMORY, SHARED_HOMES, ACROSS_HOSTS, ACROSS_HOMES, POWERSGD]


@typing.final
class Peer:
    """The other worker: its gradient per parameter this step (None: it computed none), and
    its answers to the control calls (by operation; missing: the same as this worker's)."""

    def __init__(self) -> None:
        self._grads: dict[int, torch.Tensor | None] = {}
        self._refs: list[weakref.ref[torch.Tensor]] = []
        self.answers: dict[str, list[int]] = {}
        self.events: list[tuple[str, object]] = []  # ("grad", name) from the test's hooks, ("launch", bucket index)
        self.sparse_calls = 0

    def set(self, grads: Mapping[torch.Tensor, torch.Tensor | None]) -> None:
        """The peer's gradients for this step, by parameter (of this worker's model)."""
        self._grads = {id(p): g for p, g in grads.items()}
        self._refs = [weakref.ref(p) for p in grads]

    def grad(self, param: torch.Tensor) -> torch.Tensor | None:
        return self._grads.get(id(param))

    def grad_whose_own_is(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """The peer's gradient for the parameter whose gradient here is ``tensor``."""
        for ref in self._refs:
            param = ref()
            if param is not None and param.grad is tensor:
                return self._grads[id(param)]
        raise AssertionError("a tensor reduced across workers that is no parameter's gradient")

    def sparse_all_reduce(self, grad: torch.Tensor | None, param: torch.Tensor) -> torch.Tensor | None:
        """The synchroniser's ``sparse_all_reduce``: this worker's sparse gradient (None: it has
        none) plus the peer's, for ``param``."""
        self.sparse_calls += 1
        theirs = self.grad(param)
        if theirs is not None and theirs.layout == torch.strided:
            theirs = None  # a dense one travelled in its bucket
        if grad is None:
            return None if theirs is None else theirs.coalesce()
        return grad if theirs is None else (grad + theirs).coalesce()


@dataclasses.dataclass(frozen=True)
class Launch:
    """What one ``launch`` saw."""

    bucket: int  # its index in the last plan
    params: tuple[int, ...]  # its parameters, by id
    divisor: int
    flags: list[float] | None  # this worker's flags (None where the transport reads the gradients)
    from_slots: bool  # the gradients reached the flat from the bucket's slots
    undivided: bool = False  # the flat holds the gradients undivided (the transport divides)

    def flag(self, param: torch.Tensor) -> bool:
        """Whether this worker's flag for ``param`` says it has a dense gradient for it (above 0:
        a bucket of many gradients is divided whole, its flags with it)."""
        assert self.flags is not None
        return self.flags[self.params.index(id(param))] > 0

    def sparse_flag(self, param: torch.Tensor) -> bool:
        """Whether this worker's flag for ``param`` says its gradient is sparse (below 0)."""
        assert self.flags is not None
        return self.flags[self.params.index(id(param))] < 0


@typing.final
class PeerBuckets(BucketTransport):
    """A bucket transport whose other worker is a :class:`Peer` (see the module docstring).

    ``carrier``: what ``plan`` returns instead of itself (a transport falling back to another).
    """

    def __init__(self, way: Way, peer: Peer, default_bytes: int = 4 * 1024 * 1024,
                 carrier: PeerBuckets | None = None):
        self.way, self.peer, self.default_bytes, self.carrier = way, peer, default_bytes, carrier
        self._planned: list[weakref.ref[GradientBucket]] = []  # the last plan's (weakly: as a real transport,
        # this one must not keep a dropped model's parameters alive)
        self.plans: list[list[list[int]]] = []  # per plan: each bucket's parameters, by id
        self.launches: list[Launch] = []
        self.finished = 0
        self._sent: dict[int, tuple[typing.Any, int]] = {}  # id(bucket) -> (what was launched, divisor)
        self._sums: dict[int, torch.Tensor] = {}  # COPIES: id(bucket) -> the shared sums
        self._homed: set[int] = set()  # ids of the buckets given a home by the last plan

    @property
    def overlaps_backward(self) -> bool:
        return self.way.overlaps_backward

    @property
    def hand_out(self) -> HandOut:
        return self.way.hand_out

    @property
    def reads_gradients(self) -> bool:
        return self.way.reads_gradients

    @property
    def buckets(self) -> list[GradientBucket]:
        """The buckets of the last plan (the synchroniser holds them until it rebuilds them)."""
        buckets = [ref() for ref in self._planned]
        assert all(b is not None for b in buckets), "the synchroniser dropped its buckets"
        return typing.cast(list, buckets)

    def default_bucket_bytes(self) -> int:
        return self.default_bytes

    def plan(self, buckets: list[GradientBucket]) -> BucketTransport:
        self._planned = [weakref.ref(b) for b in buckets]
        self.plans.append([[id(p) for p in bucket.params] for bucket in buckets])
        self._sent, self._sums = {}, {}
        if self.carrier is not None:
            return self.carrier.plan(buckets)
        self._homed = set()
        for bucket in buckets:
            if self.way.homes:
                bucket.home, bucket.undivided = bucket.flat[:bucket.size], bucket.wants_slots
                self._homed.add(id(bucket))
        return self

    def leave_home(self, bucket: GradientBucket) -> None:
        assert bucket.home is not None
        bucket.flat = torch.zeros_like(bucket.flat)  # the spare: the old home is never written again
        bucket.views, bucket.home = views_of(bucket.flat[:bucket.size], bucket.params), None

    def launch(self, bucket: GradientBucket, divisor: int) -> None:
        assert id(bucket) not in self._sent, "a bucket launched twice in one step"
        index = next(k for k, ref in enumerate(self._planned) if ref() is bucket)
        self.peer.events.append(("launch", index))
        ids = tuple(id(p) for p in bucket.params)
        if self.way.reads_gradients:
            pairs = [(p, p.grad) for p in bucket.params if any(p.grad is g for g in bucket.grads)]
            assert len(pairs) == len(bucket.grads), "bucket.grads holds a tensor that is no parameter's gradient"
            self._sent[id(bucket)] = (pairs, divisor)
            self.launches.append(Launch(index, ids, divisor, None, False))
            bucket.grads = []
        else:
            self._sent[id(bucket)] = (bucket.flat.clone(), divisor)
            self.launches.append(Launch(index, ids, divisor, bucket.flat[bucket.size:].tolist(),
                                        bucket.launched_from_slots, bucket.undivided))
        bucket.work = "launched"

    def finish(self, buckets: list[GradientBucket]) -> None:
        self.finished += 1
        for bucket in buckets:
            sent, divisor = self._sent.pop(id(bucket))  # KeyError: finished without being launched
            if self.way.reads_gradients:
                for param, grad in sent:
                    theirs = self.peer.grad(param)
                    if theirs is not None:
                        grad.add_(theirs)
                    if divisor != 1:
                        grad.div_(divisor)
                continue
            if id(bucket) in self._homed:  # the sums back in the home (or the spare)
                if bucket.undivided:  # divided as summed
                    sent[:bucket.size] /= divisor
                bucket.flat.copy_(sent + self._peer_flat(bucket, divisor))
                self._sums[id(bucket)] = bucket.flat
                continue
            total = sent + self._peer_flat(bucket, divisor)
            if self.way.hand_out is HandOut.COPIES:
                self._sums[id(bucket)] = total  # memory of the transport's, as a shared file
            else:
                bucket.flat.copy_(total)

    def _peer_flat(self, bucket: GradientBucket, divisor: int) -> torch.Tensor:
        """What the peer launched: its dense gradients divided, then its flags (a sparse one
        keeps its slot empty there too, and flags -1)."""
        flat = torch.zeros_like(bucket.flat)
        for k, (param, view) in enumerate(zip(bucket.params, views_of(flat[:bucket.size], bucket.params))):
            theirs = self.peer.grad(param)
            if theirs is not None and theirs.layout == torch.strided:
                view.copy_(theirs / divisor)
                flat[bucket.size + k] = 1
            elif theirs is not None:
                flat[bucket.size + k] = -1
        return flat

    def sums(self, bucket: GradientBucket) -> torch.Tensor:
        return self._sums[id(bucket)] if self.way.hand_out is HandOut.COPIES else bucket.flat

    def sum_views(self, bucket: GradientBucket) -> list[torch.Tensor]:
        if self.way.hand_out is HandOut.COPIES:
            return views_of(self.sums(bucket)[:bucket.size], bucket.params)
        return bucket.views


@typing.final
class PeerControl:
    """The ``WorkerControl`` calls of the synchroniser, for worker 0 of two (see the module docstring)."""

    world_size = WORLD
    rank = 0

    def __init__(self, peer: Peer):
        self.peer = peer
        self.operations: list[str] = []

    def agree_min_each(self, values: list[int], operation: str) -> list[int]:
        self.operations.append(operation)
        theirs = self.peer.answers.get(operation, values)
        return [min(a, b) for a, b in zip(values, theirs, strict=True)]

    def broadcast_ints(self, values: list[int], operation: str) -> list[int]:
        self.operations.append(operation)
        return list(values)  # worker 0's: this worker's

    def call(self, operation: str, fn: Callable, tensor: torch.Tensor, **kwargs: typing.Any) -> None:
        assert fn is dist.all_reduce and not kwargs, (fn, kwargs)
        self.operations.append(operation)
        theirs = self.peer.grad_whose_own_is(tensor)
        if theirs is not None:
            tensor.add_(theirs)


@typing.final
class Chooses:
    """A cross-worker transport as far as the synchroniser reads one: it names its bucket transport."""

    def __init__(self, buckets: BucketTransport):
        self._buckets = buckets

    def bucket_transport(self) -> BucketTransport:
        return self._buckets


@dataclasses.dataclass
class Rig:
    """A synchroniser of worker 0 and the peer behind its transport."""

    sync: BucketedGradientSync
    transport: PeerBuckets
    control: PeerControl
    peer: Peer
    op: ReduceOp

    @property
    def divisor(self) -> int:
        return WORLD if self.op is ReduceOp.MEAN else 1

    def enroll(self, *modules: nn.Module) -> None:
        """Registers every parameter (in creation order, as the scope does) and builds the buckets."""
        for module in modules:
            for param in module.parameters():
                self.sync.register(param)
        self.sync.finalize()


def rig(way: Way, bucket_bytes: int = 0, op: ReduceOp = ReduceOp.MEAN, default_bytes: int = 4 * 1024 * 1024,
        carrier: Way | None = None) -> Rig:
    peer = Peer()
    transport = PeerBuckets(way, peer, default_bytes,
                            carrier=None if carrier is None else PeerBuckets(carrier, peer, default_bytes))
    control = PeerControl(peer)
    sync = BucketedGradientSync(control, Chooses(transport), bucket_bytes, lambda: op,  # type: ignore[arg-type]
                                peer.sparse_all_reduce)
    return Rig(sync, transport, control, peer, op)


# -- plain-autograd oracles ------------------------------------------------------------------
Grads = dict[str, "torch.Tensor | None"]


def autograd_grads(module: nn.Module, loss: Callable[[nn.Module], torch.Tensor]) -> Grads:
    """Each parameter's gradient of ``loss(module)`` by plain autograd (None where it gets none)."""
    module.zero_grad(set_to_none=True)
    loss(module).backward()
    grads = {name: None if p.grad is None else p.grad.clone() for name, p in module.named_parameters()}
    module.zero_grad(set_to_none=True)
    return grads


def twin(make: Callable[[], nn.Module], model: nn.Module) -> nn.Module:
    """A copy of ``model`` (same weights, same parameters frozen) that no synchroniser watches."""
    copy = make()
    copy.load_state_dict(model.state_dict())
    for (_, mine), (_, theirs) in zip(model.named_parameters(), copy.named_parameters(), strict=True):
        theirs.requires_grad_(mine.requires_grad)
    return copy


def dense(grad: torch.Tensor | None) -> torch.Tensor | None:
    return None if grad is None else grad.to_dense()


def combined(mine: Grads, theirs: Grads, divisor: int) -> Grads:
    """The reduced gradients: None where neither worker has one, else the sum (missing ones as zeros) / divisor."""
    out: Grads = {}
    for name in mine:
        parts = [g for g in (dense(mine[name]), dense(theirs[name])) if g is not None]
        out[name] = None if not parts else sum(parts[1:], parts[0]) / divisor
    return out


def assert_grads(model: nn.Module, expected: Grads, names: Iterable[str] | None = None) -> None:
    """Every parameter's gradient (or the named ones') equals ``expected`` (None stays None)."""
    params = dict(model.named_parameters())
    for name in names if names is not None else params:
        got, want = params[name].grad, expected[name]
        if want is None:
            assert got is None, f"{name}: a gradient where no worker computed one"
            continue
        assert got is not None, f"{name}: no gradient, expected one"
        torch.testing.assert_close(got.to_dense(), want, msg=lambda m, name=name: f"{name}: {m}")
