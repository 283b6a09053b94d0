"""Standard servers: the process on each task that runs what a standalone client sends.

In STANDALONE_CLIENT mode every task of the cluster runs a standard server
(``run_standard_server()`` or ``unison server``) bound to its own cluster address. A
client that holds the cluster's key connects, sends ``worker_fn`` and the strategy,
and the server runs ``worker_fn`` in a worker context for its task and sends back the
result, or the exception and its traceback. While it runs, ``wait_for_other_workers``
is relayed to the client, which releases all workers together.

tf.distribute equivalent: ``run_standard_tensorflow_server`` and the standard server
of ``distribute_coordinator``. Difference: the server runs the function itself (there
is no remote graph session to connect to).
"""

from __future__ import annotations

import dataclasses
import threading
import traceback
from collections.abc import Callable, Mapping
from typing import Any

from unison._cluster import multi_worker_util
from unison._cluster.base import format_master_url
from unison._cluster.spec import ClusterLike, ClusterSpec
from unison._cluster.tf_config import read_tf_config
from unison._coordinator.channel import HANDSHAKE_SECONDS, Channel, ChannelListener, connect, require_authkey
from unison._coordinator.worker_context import run_in_worker_context
from unison.errors import ClusterError

__all__ = ["RunRequest", "StandardServer", "run_standard_server", "stop_standard_servers"]

_JOIN_SLICE_S = 0.5
"""The longest ``StandardServer.join`` sleeps before it runs a signal handler left pending."""
_STOPPER_EXIT_WAIT_S = 5.0
"""How long ``StandardServer.join`` waits for the thread that served the client's stop to end."""


@dataclasses.dataclass
class RunRequest:
    """What a client asks a standard server to run (sent pickled, after authentication)."""

    fn: Callable[[Any], Any]
    strategy: Any
    cluster: dict[str, list[str]]
    task_type: str
    task_id: int
    rpc_layer: str | None
    use_barrier: bool
    #: ``host:port`` of the store the client hosts for the workers' process group: the
    #: leader's own cluster address is taken by its standard server. Handed to the
    #: strategy's ``configure`` as an argument (the server's environment is left alone).
    rendezvous: str | None = None


class _RelayBarrier:
    """The worker barrier of a standard server: asks the client, which counts arrivals."""

    def __init__(self, channel: Channel):
        self._channel = channel
        self._generation = 0
        self._lock = threading.Lock()

    def wait(self) -> None:
        with self._lock:
            self._generation += 1
            self._channel.send(("barrier", self._generation))
            reply = self._channel.recv()
        if reply[0] != "barrier_ok":
            raise ClusterError(f"the worker barrier broke: {reply[1]}")


def _reply_for(fn: Callable[[], Any]) -> tuple[Any, ...]:
    try:
        return ("result", fn())
    except Exception as e:  # sent to the client, which raises it there
        return ("error", e, traceback.format_exc())


class StandardServer:
    """Serves one task of a cluster on that task's address.

    Args:
        cluster_spec: the cluster.
        task_type: this task's type.
        task_id: this task's index.
        authkey: the cluster's key (default: from ``UNISON_AUTHKEY``/``UNISON_AUTHKEY_FILE``).
        bind_address: where to listen instead of the task's cluster address (e.g.
            ``"0.0.0.0:2222"`` behind NAT); by default the cluster address itself, never
            all interfaces.
        rpc_layer: protocol of ``target``.
        handshake_timeout: seconds a connecting peer has to prove the key, in all
            (default 10); peers that do not are cut. At most 64 are heard at once, fewer
            where the process's free file descriptors carry fewer, the oldest dropped first.
        sessions: further roles of this server: ``{"ps": handler}`` hands a connection whose
            first message is ``("ps", ...)`` to ``handler(channel, message)``, which owns it
            until it returns (parameter-server and worker sessions of ``unison.Server``).

    Raises:
        ValueError: if the task is not in the cluster, there is no key, or
            ``handshake_timeout`` is not positive.
    """

    def __init__(
        self,
        cluster_spec: ClusterLike,
        task_type: str,
        task_id: int,
        *,
        authkey: bytes | None = None,
        bind_address: str | None = None,
        rpc_layer: str | None = "tcp",
        environ: Mapping[str, str] | None = None,
        handshake_timeout: float = HANDSHAKE_SECONDS,
        sessions: Mapping[str, Callable[[Channel, Any], None]] | None = None,
    ):
        if not (isinstance(handshake_timeout, (int, float)) and handshake_timeout > 0):
            raise ValueError(f"handshake_timeout must be a positive number of seconds, got {handshake_timeout!r}")
        self._handshake_timeout = float(handshake_timeout)
        self._sessions = dict(sessions or {})
        self._cluster_spec = multi_worker_util.validate_cluster_spec(cluster_spec, task_type, task_id)
        if task_type not in self._cluster_spec.jobs:
            raise ValueError(
                f"task {task_type}:{task_id} is not in the cluster {self._cluster_spec!r}; "
                "it has no address to serve on"
            )
        self.task_type, self.task_id = task_type, task_id
        self._authkey = require_authkey(authkey, environ)
        self._bind_address = bind_address or self._cluster_spec.task_address(task_type, task_id)
        self._rpc_layer = rpc_layer
        self._listener: ChannelListener | None = None
        self._stopped = threading.Event()
        self._stopped_by: threading.Thread | None = None  # the serving thread that handled a client's stop

    @property
    def name(self) -> str:
        return f"{self.task_type}:{self.task_id}"

    @property
    def target(self) -> str:
        """This task's master URL, e.g. ``"tcp://127.0.0.1:2222"``."""
        return format_master_url(self._cluster_spec.task_address(self.task_type, self.task_id), self._rpc_layer)

    @property
    def task_address(self) -> str:
        """This task's address in the cluster spec (what its peers connect to)."""
        return self._cluster_spec.task_address(self.task_type, self.task_id)

    @property
    def address(self) -> str:
        """The address actually listened on (after ``start``)."""
        return self._listener.address if self._listener else self._bind_address

    @property
    def refused(self) -> int:
        """How many peers failed the key handshake."""
        return self._listener.refused if self._listener else 0

    def start(self) -> StandardServer:
        """Starts listening (in background threads) and returns self.

        Raises:
            ClusterError: if the address cannot be bound.
        """
        if self._listener is None:
            self._listener = ChannelListener(
                self._bind_address, self._authkey, self._serve, handshake_seconds=self._handshake_timeout
            )
        return self

    def join(self, timeout: float | None = None) -> bool:
        """Blocks until the server is stopped; returns whether it was.

        Without a timeout it waits in slices of ``_JOIN_SLICE_S``: a Ctrl-C the kernel handed to one
        of the server's threads only marks Python's handler pending, and the main thread runs it
        (KeyboardInterrupt here) only when it wakes (``unison._launch.interrupts`` says more).

        Once stopped by a client, it also waits for the thread that served the stop to end, so a
        process that exits after ``join`` has none of the server's threads left: Python 3.11 stops
        a daemon thread still running at exit wherever it next takes the GIL, which inside a torch
        op aborts the process (``benchmarks/RESULTS.md``, 'A ps task's abort at exit'). That thread
        was still closing its socket at exit in about one ps task exit in 32."""
        if timeout is not None:
            if not self._stopped.wait(timeout):
                return False
        else:
            while not self._stopped.wait(_JOIN_SLICE_S):
                pass
        stopper = self._stopped_by
        if stopper is not None and stopper is not threading.current_thread():
            stopper.join(_STOPPER_EXIT_WAIT_S)
        return True

    def stop(self) -> None:
        """Stops accepting connections and releases ``join``."""
        if self._listener is not None:
            self._listener.close()
        self._stopped.set()

    def __enter__(self) -> StandardServer:
        return self.start()

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()

    def _serve(self, channel: Channel) -> None:
        try:
            while True:
                try:
                    message = channel.recv()
                except ClusterError as e:  # a request that could not be unpickled here
                    channel.send(("error", e, ""))
                    continue
                if message[0] == "run":
                    self._run(channel, message[1])
                elif message[0] == "ping":
                    channel.send(("pong", self.task_type, self.task_id))
                elif message[0] == "stop":
                    channel.send(("stopped", self.task_type, self.task_id))
                    channel.close()  # before join returns: all that is left to this thread is to end (see join)
                    self._stopped_by = threading.current_thread()
                    self.stop()
                    return
                elif message[0] in self._sessions:
                    self._sessions[message[0]](channel, message)
                    return
                else:
                    channel.send(("error", ValueError(f"unknown request {message[0]!r}"), ""))
        except (EOFError, OSError):
            pass  # the client went away
        finally:
            channel.close()

    def _run(self, channel: Channel, request: RunRequest) -> None:
        if (request.task_type, request.task_id) != (self.task_type, self.task_id):
            error = ClusterError(
                f"the client sent work for {request.task_type}:{request.task_id} to the server of "
                f"{self.name} at {self.address}; the client's cluster spec does not match the servers'"
            )
            channel.send(("error", error, ""))
            return
        barrier = _RelayBarrier(channel) if request.use_barrier else None
        reply = self._execute(request, barrier)
        try:
            channel.send(reply)
        except Exception as e:  # the result or exception could not be pickled
            text = reply[2] if reply[0] == "error" else ""
            channel.send(("error", ClusterError(f"{self.name} could not send back its {reply[0]}: {e!r}"), text))

    def _execute(self, request: RunRequest, barrier: Any) -> Any:
        return _reply_for(
            lambda: run_in_worker_context(
                request.fn,
                request.strategy,
                ClusterSpec(request.cluster),
                request.task_type,
                request.task_id,
                request.rpc_layer,
                barrier,
                rendezvous=request.rendezvous,
            )
        )


def run_standard_server(
    *,
    authkey: bytes | None = None,
    bind_address: str | None = None,
    environ: Mapping[str, str] | None = None,
    handshake_timeout: float = HANDSHAKE_SECONDS,
) -> StandardServer:
    """Starts the standard server of the task that ``TF_CONFIG`` describes.

    Returns the started server; call ``join()`` to serve until it is stopped.
    ``handshake_timeout`` is as in ``StandardServer``.

    tf.distribute equivalent: ``distribute_coordinator.run_standard_tensorflow_server``.

    Raises:
        ValueError: if ``TF_CONFIG`` is unset or malformed, has no ``task``, has neither a
            chief nor a worker job, or no key is set.
        ClusterError: if the task's address cannot be bound.
    """
    config = read_tf_config(environ, require_task=True)
    if config is None:
        raise ValueError("TF_CONFIG is not set: a standard server needs its cluster and task; set TF_CONFIG")
    multi_worker_util.leader_task(config.cluster)  # a cluster must have a chief or a worker
    task_type, task_id = config.task_type, config.task_id
    if task_type is None or task_id is None:  # require_task guarantees both; kept for clarity of failure
        raise ValueError(
            f"TF_CONFIG gave this server no task (task type {task_type!r}, index {task_id!r}; "
            f"cluster {config.cluster.as_dict()!r}): a standard server serves one task of the cluster; "
            f'add "task": {{"type": "worker", "index": 0}} (this task\'s type and index) to TF_CONFIG'
        )
    server = StandardServer(
        config.cluster,
        task_type,
        task_id,
        authkey=authkey,
        bind_address=bind_address,
        rpc_layer=config.rpc_layer or "tcp",
        environ=environ,
        handshake_timeout=handshake_timeout,
    )
    return server.start()


def stop_standard_servers(
    cluster_spec: ClusterLike,
    *,
    authkey: bytes | None = None,
    timeout: float = 30.0,
) -> list[str]:
    """Asks the standard server of every task of the cluster to stop.

    Returns:
        The tasks (``"worker:0"``, ...) whose server confirmed.

    Raises:
        ValueError: if there is no key.
        AuthenticationError: if a server refuses the key.
        ClusterError: if a server is not up, or does not finish the key handshake, within
            ``timeout`` seconds.
    """
    spec = multi_worker_util.normalize_cluster_spec(cluster_spec)
    key = require_authkey(authkey)
    stopped = []
    for job in spec.jobs:
        for index, address in enumerate(spec.job_tasks(job)):
            channel = connect(address, key, timeout)
            try:
                channel.send(("stop",))
                if channel.recv()[0] == "stopped":
                    stopped.append(f"{job}:{index}")
            except (EOFError, OSError):
                pass
            finally:
                channel.close()
    return stopped
