"""Objects a chief sends to a worker by reference: the worker hands its own in their place.

A function the chief schedules travels pickled (cloudpickle). Some objects in it stand for
something that only the worker that runs it has: a ps variable (the worker's cached
parameter), a ``PerWorkerValues`` (the worker's component), a per-worker iterator, and the
connections a remote table reaches the ps tasks through. Such an object pickles as
:func:`reference` ``(kind, payload)``; the worker unpickles the function with
:func:`loads_on_worker`, handing it a resolver (its runtime's), and each reference becomes
what that resolver returns. The resolver is in effect only for that one call, on that
thread: nothing on a worker finds these objects through a global, and a reference
unpickled anywhere else is an error naming what it stands for (a client reference becomes
:data:`WORKER_CLIENT`, which says so when called).

Why not pickle's persistent ids: the chief would then call a Python ``persistent_id`` for
every object of every scheduled function (measured: 8-10% of the embedding workload of
``benchmarks/parameter_server.py``); a reduce runs only for the referenced objects.
"""

from __future__ import annotations

import enum
import pickle
from collections.abc import Callable
from typing import Any

from unison._state import STATE

__all__ = ["WorkerReference", "reference", "loads_on_worker", "WORKER_CLIENT"]


class WorkerReference(enum.Enum):
    """What a referenced object stands for on the worker."""

    CLIENT = "the ps client of a remote table"
    """The worker's connections to the ps tasks (payload: None)."""
    VARIABLE = "a ps variable"
    """A ps variable: the worker's cached parameter (payload: its ``VariableSpec``)."""
    PER_WORKER = "a PerWorkerValues"
    """``PerWorkerValues``: the worker's component (payload: the components by worker index)."""
    ITERATOR = "a per-worker iterator"
    """A per-worker iterator (payload: ``(dataset_id, iterator_id)``)."""


Resolver = Callable[[WorkerReference, Any], Any]


def reference(kind: WorkerReference, payload: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """What a referenced object's ``__reduce__`` returns: on a worker, its own object of ``kind``."""
    return _resolved, (kind.value, payload)


def _resolved(kind_value: str, payload: Any) -> Any:
    try:
        kind = WorkerReference(kind_value)
    except ValueError:
        raise pickle.UnpicklingError(f"unknown worker reference {kind_value!r}: the chief and this worker run "
                                     f"different unison versions") from None
    resolve: Resolver | None = STATE.reference_resolver
    if resolve is not None:
        return resolve(kind, payload)
    if kind is WorkerReference.CLIENT:
        return WORKER_CLIENT  # a copy of a remote table made here: it says where it works when used
    raise ValueError(f"{kind.value} can only be unpickled on a worker serving a ClusterCoordinator (pass it in a "
                     f"function scheduled with ClusterCoordinator.schedule; read a ps variable on the coordinator "
                     f"with `.read_value()`)")


def loads_on_worker(data: bytes, resolve: Resolver) -> Any:
    """Unpickles what the chief sent, each reference replaced by ``resolve(kind, payload)``."""
    outer = STATE.reference_resolver
    STATE.reference_resolver = resolve
    try:
        return pickle.loads(data)
    finally:
        STATE.reference_resolver = outer


class _WorkerClient:
    """Stands for the worker's ps client in a pickled remote table; called anywhere else, says where it works."""

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        return reference(WorkerReference.CLIENT, None)

    def __call__(self) -> Any:
        raise ValueError("this DynamicEmbedding's rows live on ps tasks: use it on a worker of its ClusterCoordinator, "
                         "on the chief that made it, or under the hybrid strategy that made it")


WORKER_CLIENT = _WorkerClient()
"""The client of a remote table that was pickled: the worker's, once a worker unpickles it."""
