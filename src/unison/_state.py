"""Process state: the per-thread context stacks, the worker context and the replica threads' flags.

One class, one default instance (``STATE``); tests may build their own. Each thread
has its own stack of (strategy, replica_context) entries: ``strategy.scope()`` pushes
(strategy, None) — cross-replica context — and each replica thread of ``run`` pushes
(strategy, its ReplicaContext). It also holds the distribute coordinator's worker
context of the thread's ``worker_fn``, so that the cluster rules
(``multi_worker_util.is_chief()``) can answer for it without importing the coordinator,
which builds on them; whether this thread's optimizer step writes its replica's own
components (read by the variables, set by the gradient synchroniser, which builds on
them); and which replica threads are running a step.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = ["ContextEntry", "OwnComponentWrites", "PerThread", "ProcessState", "STATE"]


@dataclass(frozen=True)
class ContextEntry:
    strategy: Any
    replica_context: Any  # ReplicaContext, or None for cross-replica context


class OwnComponentWrites(threading.local):
    """Per thread: whether an optimizer step is writing this replica's own components.

    Inside a replica, an in-place write to a MirroredVariable is normally aggregated
    across replicas; an optimizer step instead updates each replica's own copy. The
    gradient synchroniser marks its step with ``begin()``/``end()`` (the optimizer's pre
    and post step hooks), and the variables read ``active``.
    """

    depth = 0

    @property
    def active(self) -> bool:
        """True between ``begin()`` and ``end()`` in this thread."""
        return self.depth > 0

    def begin(self) -> None:
        """Marks the start of a step that writes this thread's replica's own components."""
        self.depth = 1

    def end(self) -> None:
        """Marks the end of that step."""
        self.depth = 0


class PerThread(threading.local):
    """One thread's slots: its context stack (made at the thread's first access, so the hot path
    reads an attribute, with no call and no ``AttributeError`` to catch) and the coordinator's."""

    def __init__(self) -> None:
        self.stack: list[ContextEntry] = []
        self.reference_resolver: Any = None
        self.worker_context: Any = None
        self.set_strategy_scope: Any = None


class ProcessState:
    """Holds the context stacks of every thread of this process, and the replica threads' flags.

    The flags are plain attributes, not properties: the variables read
    ``own_component_writes`` on every operation inside a replica, and the replica threads
    mark themselves busy on every step.

    Attributes:
        own_component_writes: per thread, whether an optimizer step is writing this
            replica's own components (:class:`OwnComponentWrites`). Here, below both
            ``unison._values`` (which reads it) and ``unison._gradient_sync`` (which sets
            it), so neither owns a module global for the other to change.
        busy_replica_threads: the replica threads running a step now; a thread that is
            not in it waits for its next step. Weak, so a finished thread drops out. Set
            by the threaded replica runner, read by ``replica_thread_is_idle`` (tests and
            diagnostics wait on it).
    """

    def __init__(self) -> None:
        self.per_thread = PerThread()
        """This thread's slots. ``strategy.run``'s one-device fast path reads
        ``per_thread.stack`` itself: a method call there cost a D step about 1 us of its 112,
        timed in one process (``benchmarks/RESULTS.md``, "OneDevice's step path in cache terms")."""
        self.own_component_writes = OwnComponentWrites()
        self.busy_replica_threads: weakref.WeakSet[threading.Thread] = weakref.WeakSet()

    def stack(self) -> list[ContextEntry]:
        """This thread's stack itself (append, then pop)."""
        return self.per_thread.stack

    def depth(self) -> int:
        """How many entries this thread's stack holds."""
        return len(self.stack())

    def top(self) -> ContextEntry | None:
        stack = self.stack()
        return stack[-1] if stack else None

    @property
    def reference_resolver(self) -> Any:
        """The resolver of the worker-side unpickling in progress on this thread, or None
        (``unison._ps.wire.worker_references.loads_on_worker`` sets it for one call)."""
        return self.per_thread.reference_resolver

    @reference_resolver.setter
    def reference_resolver(self, resolve: Any) -> None:
        self.per_thread.reference_resolver = resolve

    @property
    def worker_context(self) -> Any:
        """The distribute coordinator's WorkerContext of this thread, or None."""
        return self.per_thread.worker_context

    @worker_context.setter
    def worker_context(self, context: Any) -> None:
        self.per_thread.worker_context = context

    @property
    def set_strategy_scope(self) -> Any:
        """The scope ``experimental_set_strategy`` entered in this thread and left open, or None."""
        return self.per_thread.set_strategy_scope

    @set_strategy_scope.setter
    def set_strategy_scope(self, scope: Any) -> None:
        self.per_thread.set_strategy_scope = scope

    @contextmanager
    def push(self, strategy: Any, replica_context: Any) -> Iterator[None]:
        stack = self.stack()
        stack.append(ContextEntry(strategy, replica_context))
        try:
            yield
        finally:
            stack.pop()


STATE = ProcessState()
