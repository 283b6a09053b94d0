"""Objects a chief sends to a worker by reference: the worker hands its own in their place.

A function the chief schedules travels pickled. Some objects in it stand for something
that only the worker that runs it has: a ps variable (the worker's cached parameter), a
``PerWorkerValues`` (the worker's component), a per-worker iterator, and the connections a
remote table reaches the ps tasks through. Such an object says what it stands for with
``__worker_reference__() -> (WorkerReference, payload)``; :func:`dumps_for_workers` writes
that pair as a pickle persistent id, and the worker's :func:`loads_on_worker` asks the
resolver it is handed (the worker runtime) for the object. So nothing on a worker finds
these through a global: they are handed in by the unpickler of the function that uses them.
"""

from __future__ import annotations

import enum
import io
import pickle
from typing import Any, Callable

import cloudpickle

__all__ = ["WorkerReference", "dumps_for_workers", "loads_on_worker", "WORKER_CLIENT", "off_worker"]


class WorkerReference(enum.Enum):
    """What a referenced object stands for on the worker."""

    CLIENT = "client"
    """The worker's connections to the ps tasks (payload: None)."""
    VARIABLE = "variable"
    """A ps variable: the worker's cached parameter (payload: its ``VariableSpec``)."""
    PER_WORKER = "per_worker"
    """``PerWorkerValues``: the worker's component (payload: the components by worker index)."""
    ITERATOR = "iterator"
    """A per-worker iterator (payload: ``(dataset_id, iterator_id)``)."""


class _ChiefPickler(cloudpickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:  # type: ignore[override]
        method = getattr(type(obj), "__worker_reference__", None)
        if method is None:
            return None
        kind, payload = method(obj)
        return kind.value, payload


def dumps_for_workers(value: Any) -> bytes:
    """``value`` pickled by value (cloudpickle), each referenced object as its reference."""
    buffer = io.BytesIO()
    _ChiefPickler(buffer).dump(value)
    return buffer.getvalue()


class _WorkerUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, resolve: Callable[[WorkerReference, Any], Any]):
        super().__init__(io.BytesIO(data))
        self._resolve = resolve

    def persistent_load(self, pid: Any) -> Any:
        kind, payload = pid
        try:
            reference = WorkerReference(kind)
        except ValueError:
            raise pickle.UnpicklingError(f"unknown worker reference {kind!r}: the chief and this worker run "
                                         f"different unison versions") from None
        return self._resolve(reference, payload)


def loads_on_worker(data: bytes, resolve: Callable[[WorkerReference, Any], Any]) -> Any:
    """What :func:`dumps_for_workers` wrote, each reference replaced by ``resolve(kind, payload)``."""
    return _WorkerUnpickler(data, resolve).load()


def off_worker(what: str) -> Any:
    """What a referenced object unpickles to anywhere but on a worker of a ClusterCoordinator: an error."""
    raise ValueError(f"{what} can only be unpickled on a worker serving a ClusterCoordinator (pass it in a "
                     f"function scheduled with ClusterCoordinator.schedule)")


class _WorkerClient:
    """Stands for the worker's ps client in a pickled remote table; called anywhere else, says where it works."""

    def __worker_reference__(self) -> tuple[WorkerReference, None]:
        return WorkerReference.CLIENT, None

    def __call__(self) -> Any:
        raise ValueError("this DynamicEmbedding's rows live on ps tasks: use it on a worker of its ClusterCoordinator, "
                         "on the chief that made it, or under the hybrid strategy that made it")

    def __reduce__(self) -> str:
        return "WORKER_CLIENT"


WORKER_CLIENT = _WorkerClient()
"""The client of a remote table that was pickled: the worker's, once a worker unpickles it."""
