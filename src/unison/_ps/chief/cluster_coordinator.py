"""``unison.ClusterCoordinator``: schedules functions onto any free worker.

One thread per worker takes closures from the :class:`~unison._ps.chief.closure_queue.ClosureQueue`,
sends each to its worker's standard server and waits for the result. A worker whose
connection breaks (it died) gives its closure back to the queue, to run elsewhere; its
thread keeps trying to reconnect, and a worker that comes back at its address is used
again, its per-worker datasets rebuilt. A monitor pings every ps task; a ps task that
stops answering within the strategy's timeout fails every queued function and makes
``join()``/``fetch()`` raise ``ParameterServerError`` naming ``ps:K``.

tf.distribute equivalent: ``tf.distribute.experimental.coordinator.ClusterCoordinator``.
"""

from __future__ import annotations

import atexit
import threading
import typing
import weakref
from collections.abc import Callable
from typing import Any

import cloudpickle
from torch.utils._pytree import tree_map

from unison._coordinator.channel import Channel, connect
from unison._ps.chief.closure_queue import Closure, ClosureQueue
from unison._ps.chief.per_worker_datasets import PerWorkerDataset
from unison._ps.chief.remote_values import RemoteValue
from unison._ps.strategy import ParameterServerStrategy
from unison._ps.wire import protocol as wire
from unison._ps.wire.client import PSClient
from unison._ps.wire.links import set_nodelay
from unison.errors import ClusterError, ParameterServerError

__all__ = ["ClusterCoordinator"]

_RECONNECT_SECONDS = 0.5
_PING_SECONDS = 1.0


def _send_stop(address: str, authkey: bytes) -> None:
    try:
        channel = connect(address, authkey, timeout=1.0)
    except Exception:
        return  # already gone
    try:
        channel.send(("stop",))  # the standard server's own request (unison._coordinator.standard_server)
        channel.recv()
    except Exception:
        pass
    finally:
        channel.close()


class _WorkerThread:
    """Feeds one worker; reconnects when it comes back."""

    def __init__(self, coordinator: ClusterCoordinator, index: int, address: str):
        self._coordinator = coordinator
        self.index, self.address = index, address
        self._channel: Channel | None = None
        self._datasets_sent = 0
        self.connected = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"unison-ps-worker-{index}", daemon=True)
        self._thread.start()

    def _connect(self) -> bool:
        c = self._coordinator
        try:
            channel = connect(self.address, c._authkey, timeout=_RECONNECT_SECONDS)
            set_nodelay(channel)
            channel.send(("worker", {"ps": c._ps_addresses, "worker_index": self.index,
                                     "num_workers": len(c._workers_addresses), "timeout": c._timeout}))
        except Exception:
            return False
        self._channel, self._datasets_sent = channel, 0
        self.connected.set()
        return True

    def _lost(self) -> None:
        if self._channel is not None:
            self._channel.close()
        self._channel = None
        self.connected.clear()

    def _call(self, request: wire.WorkerRequest) -> wire.FunctionResult | wire.FunctionFailed:
        assert self._channel is not None
        self._channel.send(request)
        return self._channel.recv()

    def _loop(self) -> None:
        c = self._coordinator
        while not c._stopping.is_set():
            if self._channel is None and not self._connect():
                c._stopping.wait(_RECONNECT_SECONDS)
                continue
            closure = c._queue.get()
            if closure is None:
                continue
            try:
                self._send_datasets()  # new datasets, or a worker that came back
                reply = self._call(wire.RunFunction(closure.payload))
            except (EOFError, OSError, ClusterError):
                c._queue.put_back(closure)  # at-least-once: the worker died mid-function
                self._lost()
                continue
            if isinstance(reply, wire.FunctionResult):
                c._queue.finished(closure, reply.value)
            elif reply.lost_ps:  # the worker lost a ps task: nothing can run any more
                error = self._error_of(reply)
                c._queue.fail_all(error)
                c._queue.failed(closure, error)
            else:
                c._queue.failed(closure, self._error_of(reply))

    def _send_datasets(self) -> None:
        c = self._coordinator
        while self._datasets_sent < len(c._datasets):
            dataset_id, fn = c._datasets[self._datasets_sent]
            reply = self._call(wire.BuildDataset(dataset_id, fn))
            if isinstance(reply, wire.FunctionFailed):
                c._report(self._error_of(reply))
            self._datasets_sent += 1

    def _error_of(self, reply: wire.FunctionFailed) -> BaseException:
        error = reply.error
        if reply.traceback:
            try:
                error.add_note(f"traceback on worker:{self.index}:\n{reply.traceback}")
            except AttributeError:
                pass
        return error

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


#: The coordinator of each strategy (one per strategy, as in TensorFlow).
_COORDINATORS: weakref.WeakKeyDictionary[Any, ClusterCoordinator] = weakref.WeakKeyDictionary()


@typing.final
class ClusterCoordinator:
    """Schedules functions on the workers of a ParameterServerStrategy's cluster.

    One per strategy: constructing it again returns the same object. Functions and
    their arguments travel with cloudpickle; parameters created in the strategy's
    scope travel as references to their ps tasks. When the coordinator's process
    exits (or ``shutdown()`` is called) every worker and ps server is asked to stop.

    Example::

        coordinator = unison.ClusterCoordinator(strategy)
        result = coordinator.schedule(step, args=(iter(per_worker_dataset),))
        coordinator.join()
        print(result.fetch())

    Args:
        strategy: a ``ParameterServerStrategy``.

    Raises:
        ValueError: for any other strategy.
    """

    _initialized: bool = False

    def __new__(cls, strategy: Any) -> ClusterCoordinator:
        if not isinstance(strategy, ParameterServerStrategy):
            raise ValueError(
                f"ClusterCoordinator needs a ParameterServerStrategy, got {type(strategy).__name__}; "
                f"create `unison.ParameterServerStrategy(resolver)` first"
            )
        existing = _COORDINATORS.get(strategy)
        if existing is not None:
            return existing
        coordinator = super().__new__(cls)
        coordinator._initialized = False
        _COORDINATORS[strategy] = coordinator
        return coordinator

    def __init__(self, strategy: Any):
        if self._initialized:
            return
        self._initialized = True
        self._strategy = strategy
        info = strategy.ps_cluster
        self._authkey, self._timeout = info.authkey, info.timeout
        self._ps_addresses, self._workers_addresses = list(info.ps), list(info.workers)
        self._queue = ClosureQueue()
        self._datasets: list[tuple[int, Callable[..., Any]]] = []
        self._stopping = threading.Event()
        self._workers = [_WorkerThread(self, i, a) for i, a in enumerate(self._workers_addresses)]
        self._monitor = threading.Thread(target=self._watch_ps, name="unison-ps-monitor", daemon=True)
        self._monitor.start()
        atexit.register(self.shutdown)

    @property
    def strategy(self) -> Any:
        """The strategy this coordinator schedules for."""
        return self._strategy

    def _report(self, error: BaseException) -> None:
        closure = Closure(b"", "dataset_fn")
        with self._queue._cond:
            self._queue._inflight += 1
        self._queue.failed(closure, error)

    def _watch_ps(self) -> None:
        client = PSClient(self._ps_addresses, self._authkey, timeout=self._timeout, reply_timeout=self._timeout)
        try:
            while not self._stopping.wait(_PING_SECONDS):
                for index in range(len(self._ps_addresses)):
                    try:
                        client.ping(index)
                    except ParameterServerError as e:
                        self._queue.fail_all(e)
                        return
        finally:
            client.close()

    # -- the API ------------------------------------------------------------------------
    def schedule(self, fn: Callable[..., Any], args: tuple | list | None = None,
                 kwargs: dict | None = None) -> RemoteValue:
        """Queues ``fn(*args, **kwargs)`` to run on some worker; returns its RemoteValue at once.

        Raises:
            The first error of an earlier function (once), or ParameterServerError.
            TypeError: if ``fn`` or its arguments cannot be pickled.
        """
        self._strategy.extended.finish_variable_creation()
        try:
            payload = cloudpickle.dumps((fn, tuple(args or ()), dict(kwargs or {})))
        except Exception as e:
            raise TypeError(
                f"schedule: {getattr(fn, '__name__', fn)!r} or its arguments cannot be pickled ({e!r})"
            ) from e
        closure = Closure(payload, getattr(fn, "__name__", repr(fn)))
        self._queue.put(closure)
        return closure.result

    def join(self) -> None:
        """Blocks until every scheduled function finished; raises the first error (once)."""
        self._queue.wait()

    def done(self) -> bool:
        """Whether every scheduled function finished; raises the first error (once)."""
        return self._queue.done()

    def fetch(self, val: Any) -> Any:
        """``val`` with every RemoteValue in it replaced by its result (blocking)."""
        if isinstance(val, RemoteValue):
            return val.fetch()
        return tree_map(lambda v: v.fetch() if isinstance(v, RemoteValue) else v, val)

    def create_per_worker_dataset(self, dataset_fn: Callable[..., Any]) -> PerWorkerDataset:
        """Has every worker call ``dataset_fn()`` (or ``dataset_fn(InputContext)``) to make its dataset."""
        if not callable(dataset_fn):
            raise TypeError(f"create_per_worker_dataset: `dataset_fn` must be callable, got {dataset_fn!r}")
        dataset_id = len(self._datasets)
        self._datasets.append((dataset_id, dataset_fn))
        return PerWorkerDataset(dataset_id, len(self._workers_addresses))

    def shutdown(self) -> None:
        """Stops scheduling and asks every worker and ps server to stop (their ``join()`` returns)."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._queue.stop()
        for address in self._workers_addresses + self._ps_addresses:
            _send_stop(address, self._authkey)
        for worker in self._workers:
            worker.join(2.0)
        self._monitor.join(2.0)
        client = self._strategy.extended.components.variable_policy.connected_client
        if client is not None:
            client.close()
        atexit.unregister(self.shutdown)
