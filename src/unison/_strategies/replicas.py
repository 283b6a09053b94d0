"""Replica runners: how ``strategy.run`` executes one function per local replica.

``InlineReplicaRunner`` runs the only replica in the caller's thread: no thread, no
hand-off, so a one-device step costs what plain PyTorch costs. ``ThreadedReplicaRunner``
runs the replicas at once, like TensorFlow's MirroredStrategy: CPU replica 0 in the
caller's thread and one thread per other device (CUDA: one thread per device, the
caller coordinating), and implements ``merge_call`` as a rendezvous of the replicas,
the last to arrive running the merge function in cross-replica context.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import typing
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from unison._context import ReplicaContext
from unison._devices import is_cuda, torch_device
from unison._interpose.grad_scaler import install_grad_scaler_replicas
from unison._interpose.once_per_step import install_once_per_step
from unison._state import STATE, ContextEntry
from unison._strategies.switch_interval import SHORT_SWITCH_INTERVAL
from unison._values.values import may_hold_components, regroup, select_replica
from unison.errors import MergeCallError

if TYPE_CHECKING:  # pragma: no cover
    from unison._strategies.base import Strategy

__all__ = ["PLAIN_TENSOR", "InlineReplicaRunner", "ThreadedReplicaRunner", "replica_runner"]


def replica_runner(strategy: Strategy, devices: Sequence[str]) -> InlineReplicaRunner | ThreadedReplicaRunner:
    """The runner for ``devices``: inline for one device, one thread per device otherwise."""
    return InlineReplicaRunner(strategy, devices) if len(devices) == 1 else ThreadedReplicaRunner(strategy, devices)


def _first_replica_id(strategy: Strategy, num_local: int) -> int:
    """The global id of this worker's first replica (read when the strategy is complete)."""
    return strategy.extended.components.worker_index * num_local


PLAIN_TENSOR = frozenset({torch.Tensor})
"""``PLAIN_TENSOR.issuperset(map(type, args))``: every argument a plain tensor (the common step),
checked in C, without a Python frame."""


@typing.final
class InlineReplicaRunner:
    """Runs the single local replica in the calling thread."""

    def __init__(self, strategy: Strategy, devices: Sequence[str] = ("cpu:0",)):
        self._strategy = strategy
        self._context: ReplicaContext | None = None
        self._entry: ContextEntry | None = None

    @property
    def context(self) -> ReplicaContext:
        """The one replica's context (made on first use, once the strategy is complete)."""
        if self._context is None:
            self._context = ReplicaContext(self._strategy, 0, _first_replica_id(self._strategy, 1), self._merge)
        return self._context

    @property
    def entry(self) -> ContextEntry:
        """What ``run`` pushes on the thread's context stack (made on first use)."""
        if self._entry is None:
            self._entry = ContextEntry(self._strategy, self.context)
        return self._entry

    def run(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        # The fast path: no pytree walk for plain arguments, no generator-based context
        # manager; one cached entry pushed on this thread's context stack.
        if (kwargs or not PLAIN_TENSOR.issuperset(map(type, args))) and may_hold_components((args, kwargs)):
            args, kwargs = select_replica(0, (args, kwargs))
        entry = self._entry
        if entry is None:
            entry = self.entry
        stack = STATE.per_thread.stack
        stack.append(entry)
        try:
            return fn(*args, **kwargs)
        finally:
            stack.pop()

    def _merge(self, replica_id: int, merge_fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        with STATE.push(self._strategy, None):
            result = merge_fn(self._strategy, *args, **kwargs)
        return select_replica(0, result)


class _MergeAborted(BaseException):
    """Unwinds a replica thread waiting in merge_call after another replica failed."""


_RUNNING, _MERGE, _DONE, _FAILED = "running", "merge", "done", "failed"


class _Rendezvous:
    """Shared state of one ``run`` call: replica statuses and merge hand-offs.

    The last replica to reach a ``merge_call`` runs the merge function itself, in
    cross-replica context, and wakes the others: two thread hand-offs fewer per merge
    than handing it to the thread that called ``run``. That thread only waits until
    every replica finished, and sorts out failures.
    """

    def __init__(self, num_replicas: int, run_merge: Callable[[_Rendezvous], BaseException | None] | None):
        self.cv = threading.Condition()
        self.status = [_RUNNING] * num_replicas
        self.requests: list[Any] = [None] * num_replicas
        self.results: list[Any] = [None] * num_replicas
        self.errors: list[BaseException | None] = [None] * num_replicas
        self.merge_results: list[Any] = [None] * num_replicas
        self.merge_error: BaseException | None = None
        self.error: BaseException | None = None  # what run raises, once decided
        self.generation = 0
        self.aborted = False
        self.merging = False
        self._run_merge = run_merge  # None: the caller of run merges (CUDA replicas: its device is current)

    def merge_call(self, replica_id: int, merge_fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        with self.cv:
            if self.aborted:
                raise _MergeAborted()
            self.status[replica_id] = _MERGE
            self.requests[replica_id] = (merge_fn, args, kwargs)
            generation = self.generation
            if self._run_merge is not None and all(s == _MERGE for s in self.status):
                self.merging = True  # the last to arrive: merge here (the caller of run stays asleep)
                try:
                    error = self._run_merge(self)
                finally:
                    self.merging = False
                if error is not None:
                    self.merge_error = error
                self.resume(aborted=error is not None)
            elif self.settled():
                self.cv.notify_all()  # a replica finished or failed without merging: someone decides
            while self.generation == generation:
                if self._run_merge is not None and self.settled():
                    # Every other replica returned or failed: this merge never completes. Any
                    # thread holding the lock may decide; a waiting replica, because with CPU
                    # replicas the caller of run may be this very thread (it hosts replica 0),
                    # and before waiting, since the others may have settled before it came.
                    self.decide(None)
                    if self.generation != generation:
                        break
                self.cv.wait()
            if self.aborted:
                raise _MergeAborted()
            return self.merge_results[replica_id]

    def finish(self, replica_id: int, status: str) -> None:
        """Marks a replica done or failed (lock held by the caller); wakes the caller of run once all settled."""
        self.status[replica_id] = status
        if self.settled():
            self.cv.notify_all()

    def settled(self) -> bool:
        return not self.merging and all(s != _RUNNING for s in self.status)

    def decide(self, run_merge: Callable[[_Rendezvous], BaseException | None] | None) -> bool:
        """With every replica settled (lock held): records the error to raise and unwinds
        replicas waiting in a merge that cannot complete; True once no replica waits.

        What a replica cannot decide alone: a merge that failed, a replica that failed
        while others wait in a merge, or replicas that disagree on whether to merge.
        When every replica waits in a merge, ``run_merge`` runs it (CUDA replicas: the
        caller of run merges); without one nothing is decided (False).
        """
        failed = [e for e in self.errors if e is not None]
        if self.error is None and self.merge_error is not None:
            self.error = self.merge_error
        if self.error is None and failed:
            self.error = failed[0]
        waiting = [i for i, s in enumerate(self.status) if s == _MERGE]
        if not waiting:
            return True
        if self.error is not None:
            self.resume(aborted=True)
            return False
        if len(waiting) != len(self.status):
            done = [i for i, s in enumerate(self.status) if s == _DONE]
            self.error = MergeCallError(
                f"replicas {waiting} called merge_call but replicas {done} returned without "
                f"calling it: every replica must make the same merge_call/all_reduce calls "
                f"(check for replica-dependent control flow around them)"
            )
            self.resume(aborted=True)
            return False
        if run_merge is not None:
            self.error = run_merge(self)
            self.resume(aborted=self.error is not None)
        return False

    def resume(self, aborted: bool = False) -> None:
        """Wakes every replica waiting in merge_call (lock held by the caller)."""
        self.aborted = self.aborted or aborted
        self.status = [_RUNNING if s == _MERGE else s for s in self.status]
        self.generation += 1
        self.cv.notify_all()


def _autocast_state() -> tuple[tuple[str, torch.dtype], ...]:
    """The caller's enabled autocast regions, as (device type, dtype) pairs.

    Autocast is per thread: replica 0 of CPU replicas runs in the caller's thread and
    sees the caller's; the other replica threads enter the same, so that every replica
    computes alike (as they get the caller's grad mode).
    """
    return tuple((device, torch.get_autocast_dtype(device)) for device in ("cpu", "cuda")
                 if torch.is_autocast_enabled(device))


def _autocast(state: tuple[tuple[str, torch.dtype], ...]) -> contextlib.AbstractContextManager:
    """Enters the autocast regions of ``state`` (none: a no-op context)."""
    if not state:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    for device, dtype in state:
        stack.enter_context(torch.autocast(device, dtype=dtype))
    return stack


def replica_thread_is_idle(thread: threading.Thread) -> bool:
    """Whether a replica thread is waiting for its next step (for tests and diagnostics)."""
    return thread not in STATE.busy_replica_threads


def _serve_replica(requests: queue.SimpleQueue[Any], threads: int, ready: threading.Event) -> None:
    """A replica thread: runs each step it is handed until it is handed None."""
    me = threading.current_thread()
    torch.get_num_threads()  # torch's lazy per-thread set-up first: it would take the process-wide count
    torch.set_num_threads(threads)
    ready.set()
    while True:
        item = requests.get()
        if item is None:
            return
        STATE.busy_replica_threads.add(me)
        try:
            target, args = item
            target(*args)
        finally:
            STATE.busy_replica_threads.discard(me)
        del item, target, args  # drop the step's references while waiting for the next


def _stop_replicas(queues: list[queue.SimpleQueue[Any]]) -> None:
    for requests in queues:
        requests.put(None)


@typing.final
class ThreadedReplicaRunner:
    """Runs the local replicas at once and coordinates their merge calls.

    With CPU devices, replica 0 runs in the thread that calls ``run`` and replicas 1..
    in threads of their own: one thread wake per step fewer than a thread for every
    replica (the caller would only wait). CUDA replicas each get a thread, which keeps
    its device current, and the caller runs their merges under its own device.

    The replica threads are started on the first ``run`` and kept, waiting for the next
    step (a thread start per replica per step cost more than a small step).

    Each of the ``n`` replicas computes with ``threads // n`` intra-op threads (at least
    one): the replica threads from their start, replica 0 in the caller's thread only
    for the step (the caller's count is set back after it). With every replica thread
    owning a full OpenMP team, libgomp counts more busy threads than CPUs and stops
    spinning at its barriers: every parallel region then sleeps and wakes its team, which
    slows the replicas' steps and even plain PyTorch in the same process while an idle
    replica thread exists (as ``OMP_WAIT_POLICY=PASSIVE`` does).
    The replicas run at once: running them one at a time, passing a baton at merge
    calls (as TensorFlow's eager MirroredStrategy does), measured slower
    (``benchmarks/RESULTS.md``, 'Intra-op threads per replica, replicas at once').
    """

    def __init__(self, strategy: Strategy, devices: Sequence[str]):
        # A step's one GradScaler serves every replica (_interpose/grad_scaler.py), and
        # scheduler.step(), ema.update_parameters() run once per step (_interpose/once_per_step.py).
        install_grad_scaler_replicas()
        install_once_per_step()
        self._strategy = strategy
        self._devices = tuple(devices)
        self._queues: list[queue.SimpleQueue[Any]] = []
        self._lock = threading.Lock()
        # Merges run in the last replica to arrive, except on CUDA, where the merge then
        # would run under that replica's current device instead of the caller's.
        self._merge_in_replica = None if any(is_cuda(d) for d in self._devices) else self._run_merge
        # CPU replicas: the caller of run runs replica 0 itself, so a step wakes one thread
        # fewer (see the class docstring); CUDA replicas each get a thread, which keeps its
        # device current, and the caller merges.
        self._first_threaded = 0 if self._merge_in_replica is None else 1

    def _share(self) -> int:
        return max(1, torch.get_num_threads() // len(self._devices))

    def _start_threads(self) -> list[queue.SimpleQueue[Any]]:
        with self._lock:
            if not self._queues:
                first = self._first_threaded
                queues: list[queue.SimpleQueue[Any]] = [queue.SimpleQueue() for _ in self._devices[first:]]
                own, share = torch.get_num_threads(), self._share()
                started = []
                for i, requests in enumerate(queues, start=first):
                    ready = threading.Event()
                    threading.Thread(target=_serve_replica, args=(requests, share, ready),
                                     name=f"unison-replica-{i}", daemon=True).start()
                    started.append(ready)
                for ready in started:
                    ready.wait(10.0)
                # torch.set_num_threads also sets the count threads started later take: the
                # caller's again, not a replica's share
                torch.set_num_threads(own)
                # the threads wait on their queues; when the runner goes, they are told to stop
                weakref.finalize(self, _stop_replicas, queues)
                self._queues = queues
        return self._queues

    def run(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        n = len(self._devices)
        rendezvous = _Rendezvous(n, self._merge_in_replica)
        modes = (torch.is_grad_enabled(), _autocast_state())  # the caller's, for every replica
        queues = self._queues or self._start_threads()
        first = self._first_threaded
        with SHORT_SWITCH_INTERVAL:  # the replica threads contend for the GIL (switch_interval.py)
            for i, requests in enumerate(queues, start=first):
                requests.put((self._replica_main, (rendezvous, i, fn, *select_replica(i, (args, kwargs)), modes)))
            if first:  # CPU replicas: replica 0 runs here, while the threads run the others
                first_args, first_kwargs = select_replica(0, (args, kwargs))
                own = torch.get_num_threads()
                share = self._share()
                if own != share:
                    torch.set_num_threads(share)
                try:
                    self._replica_main(rendezvous, 0, fn, first_args, first_kwargs, modes)
                finally:
                    if own != share:
                        torch.set_num_threads(own)
            error = self._coordinate(rendezvous)
        if error is not None:
            raise error
        return regroup(rendezvous.results)

    def _replica_main(
        self, rendezvous: _Rendezvous, replica_id: int, fn: Callable[..., Any], args: tuple, kwargs: dict,
        modes: tuple[bool, tuple[tuple[str, torch.dtype], ...]],
    ) -> None:
        first = _first_replica_id(self._strategy, len(self._devices))
        context = ReplicaContext(self._strategy, replica_id, first + replica_id, rendezvous.merge_call)
        device = self._devices[replica_id]
        try:
            grad_enabled, autocast = modes
            with STATE.push(self._strategy, context), torch.set_grad_enabled(grad_enabled), _autocast(autocast):
                if is_cuda(device):
                    with torch.cuda.device(torch_device(device)):
                        result = fn(*args, **kwargs)
                else:
                    result = fn(*args, **kwargs)
        except _MergeAborted:
            with rendezvous.cv:
                rendezvous.finish(replica_id, _DONE)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller of run
            with rendezvous.cv:
                rendezvous.errors[replica_id] = exc
                rendezvous.finish(replica_id, _FAILED)
        else:
            with rendezvous.cv:
                rendezvous.results[replica_id] = result
                rendezvous.finish(replica_id, _DONE)

    def _coordinate(self, rv: _Rendezvous) -> BaseException | None:
        """Waits until every replica finished; returns the error to raise (see ``_Rendezvous.decide``)."""
        with rv.cv:
            while True:
                rv.cv.wait_for(rv.settled)
                if rv.decide(self._run_merge):
                    return rv.error

    def _run_merge(self, rv: _Rendezvous) -> BaseException | None:
        merge_fn = rv.requests[0][0]
        args = regroup([request[1] for request in rv.requests])
        kwargs = regroup([request[2] for request in rv.requests])
        rv.cv.release()  # replicas are all parked; let merge_fn take as long as it needs
        try:
            with STATE.push(self._strategy, None):
                result = merge_fn(self._strategy, *args, **kwargs)
            rv.merge_results = [select_replica(i, result) for i in range(len(rv.status))]
            return None
        except BaseException as exc:  # noqa: BLE001 - handed to the caller of run
            return exc
        finally:
            rv.cv.acquire()
