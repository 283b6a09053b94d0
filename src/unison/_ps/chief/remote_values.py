"""RemoteValue and PerWorkerValues: what a ClusterCoordinator hands back.

tf.distribute equivalents: ``tf.distribute.experimental.coordinator.RemoteValue`` and
``PerWorkerValues``.
"""

from __future__ import annotations

import threading
import typing
from collections.abc import Sequence
from typing import Any

from unison._ps.wire.worker_references import WorkerReference, reference

__all__ = ["RemoteValue", "PerWorkerValues"]


class RemoteValue:
    """The future result of a function scheduled with ``ClusterCoordinator.schedule``.

    ``fetch()`` (or ``get()``) blocks until the function ran on some worker and returns
    its result, or raises its error: the user's exception (original type, with the
    worker's traceback as a note), ``FunctionCancelledError`` when an earlier function
    failed before this one ran, or ``ParameterServerError`` when a ps task was lost.
    """

    def __init__(self) -> None:
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    def _set(self, value: Any) -> None:
        self._value, self._error = value, None
        self._done.set()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._done.set()

    def done(self) -> bool:
        """Whether the function finished (with a value or an error)."""
        return self._done.is_set()

    def fetch(self, timeout: float | None = None) -> Any:
        """Waits for the result and returns it (raises the function's error).

        Raises:
            TimeoutError: if ``timeout`` seconds pass first.
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"the scheduled function did not finish within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._value

    def get(self) -> Any:
        """Same as ``fetch()``: the result, once available."""
        return self.fetch()

    def __repr__(self) -> str:
        state = "error" if self._error is not None else ("done" if self.done() else "pending")
        return f"RemoteValue({state})"


@typing.final
class PerWorkerValues:
    """One value per worker; a scheduled function receives the component of the worker it runs on.

    ``iter()`` of a per-worker dataset gives one; pass it in ``args`` of ``schedule``.
    """

    def __init__(self, values: Sequence[Any]):
        self._values = tuple(values)

    @property
    def values(self) -> tuple[Any, ...]:
        """The components, by worker index."""
        return self._values

    def __reduce__(self) -> tuple:
        """In a scheduled function: the worker's component (:mod:`unison._ps.wire.worker_references`)."""
        return reference(WorkerReference.PER_WORKER, self._values)

    def __repr__(self) -> str:
        return f"PerWorkerValues({list(self._values)!r})"
