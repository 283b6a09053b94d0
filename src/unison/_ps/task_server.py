"""``unison.Server``: the standard server of a cluster task, in its ps or worker role.

One process per task runs it. A ps task keeps a :class:`~unison._ps.task.parameter_store.ParameterStore`
and answers pulls and pushes; a worker task runs the functions a ClusterCoordinator
sends, one at a time. Both are sessions of the same authenticated standard server the
distribute coordinator uses (:class:`~unison._coordinator.standard_server.StandardServer`), so
nothing is unpickled before the key check. ``join()`` returns when the coordinator
shuts the cluster down.

**Workers that serve the ps tasks** (:class:`HostedPS`, ``unison launch --ps-in-workers``).
On one host, a hybrid job's ps tasks are processes beside the workers: every pull and push
crosses a socket and wakes another process, and the ps tasks' CPU competes with the
workers' (the hybrid DLRM on 2 cores ran four busy processes). With
``UNISON_PS_IN_WORKERS=1`` no process runs the ps tasks: worker ``i`` serves ps task ``j``
for each ``j % num_workers == i``, on ps task ``j``'s cluster address. The other workers
reach it as before, over its socket; worker ``i``'s own requests to it are applied in its
own thread, without a socket (:mod:`unison._ps.task.in_process_link`). The rows, the table
policies and the semantics are those of separate ps tasks.

The trade: a ps task lives as long as the worker that serves it. A lost worker takes its
rows with it (the job restores its last checkpoint), where separate ps tasks keep them
while ``--max-restarts`` restarts the workers; the launcher refuses the two together.

tf.distribute equivalent: ``tf.distribute.Server``.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Mapping
from typing import Any, cast

from unison._cluster.env import ps_in_workers, ps_shared_memory
from unison._cluster.multi_worker_util import normalize_cluster_spec
from unison._coordinator.channel import Channel, require_authkey
from unison._coordinator.standard_server import StandardServer
from unison._gradient_sync.step_hooks import install_step_hooks
from unison._ps.task.in_process_link import InProcessLink
from unison._ps.task.malloc_settings import release_large_buffers
from unison._ps.task.parameter_store import ParameterStore
from unison._ps.task.scheduling import serve_at_batch_priority
from unison._ps.task.sessions import accept_session, serve_ps_session
from unison._ps.wire import in_process
from unison._ps.wire import protocol as wire
from unison._ps.wire.client import PSClient
from unison._ps.wire.links import serving_link, set_nodelay
from unison._ps.wire.worker_references import loads_on_worker
from unison._ps.worker.runtime import RUNTIME, WorkerRuntime, build_dataset
from unison.errors import ParameterServerError

__all__ = ["Server", "HostedPS", "hosted_ps_indices"]

SESSION_EXIT_WAIT_S = 10.0
"""How long ``join`` waits, in all, for the session threads it closed to end."""


def _resolve(cluster: Any, job_name: str | None, task_index: int | None) -> tuple[Any, str, int]:
    if hasattr(cluster, "cluster_spec") and callable(cluster.cluster_spec):  # a ClusterResolver
        job_name = job_name if job_name is not None else cluster.task_type
        task_index = task_index if task_index is not None else cluster.task_id
        cluster = cluster.cluster_spec()
    if job_name is None:
        raise ValueError(
            "Server needs `job_name` (the task's type, e.g. 'ps' or 'worker'): pass it or a resolver that knows it"
        )
    return cluster, job_name, 0 if task_index is None else task_index


class Server:
    """Serves one task of a parameter-server cluster (``tf.distribute.Server``).

    Example (in each worker and ps process)::

        resolver = unison.TFConfigClusterResolver()
        unison.Server(resolver).join()

    Args:
        cluster_resolver_or_spec: a ClusterResolver, a ClusterSpec or a dict of jobs.
        job_name: this task's type (default: the resolver's).
        task_index: this task's index (default: the resolver's, else 0).
        start: start serving now (as ``tf.distribute.Server``'s default).
        authkey: the cluster's key (default: ``UNISON_AUTHKEY``/``UNISON_AUTHKEY_FILE``).
        bind_address: where to listen instead of the task's address (``"127.0.0.1:0"``
            picks a free port; read ``address``).
        in_process: a ps task served inside a worker's process (``unison launch
            --ps-in-workers``): that process's own requests to it skip the socket
            (:mod:`unison._ps.task.in_process_link`), and the process's memory settings
            stay a worker's.

    Raises:
        ValueError: if the task is not in the cluster or no key is set.
    """

    def __init__(self, cluster_resolver_or_spec: Any, job_name: str | None = None, task_index: int | None = None,
                 *, start: bool = True, authkey: bytes | None = None, bind_address: str | None = None,
                 in_process: bool = False):
        cluster, job_name, task_index = _resolve(cluster_resolver_or_spec, job_name, task_index)
        self._authkey = require_authkey(authkey)
        self._store = ParameterStore(task_index) if job_name == "ps" else None
        if self._store is not None and not in_process:
            release_large_buffers()  # a ps task's batch buffers go back when freed (not a worker's: page faults)
        self._session_lock = threading.Lock()
        self._sessions: dict[threading.Thread, Channel] = {}
        self._sessions_lock = threading.Lock()
        self._sessions_closed = False  # join closed them: a session admitted since is refused
        self._ps_sessions = threading.Condition()
        self._ps_sessions_opened = self._ps_sessions_open = 0
        self._server = StandardServer(cluster, job_name, task_index, authkey=self._authkey, bind_address=bind_address,
                                      sessions={"ps": self._ps_session, "worker": self._worker_session})
        self._hosted: HostedPS | None = None
        # a worker under UNISON_PS_IN_WORKERS=1 serves its share of the ps tasks, from start() on
        self._hosts_ps = (normalize_cluster_spec(cluster).as_dict(), task_index) if job_name == "worker" else None
        self._in_process_address: str | None = None
        if in_process and self._store is not None:
            self._in_process_address = self._server.task_address
        if start:
            self.start()

    @property
    def address(self) -> str:
        """The ``host:port`` served."""
        return self._server.address

    @property
    def target(self) -> str:
        """This task's URL, e.g. ``"tcp://127.0.0.1:2222"``."""
        return self._server.target

    def start(self) -> Server:
        """Starts serving in background threads."""
        if self._hosts_ps is not None and self._hosted is None:
            self._hosted = HostedPS.for_task(self._hosts_ps[0], "worker", self._hosts_ps[1], self._authkey)
        try:
            self._server.start()
        except BaseException:
            if self._hosted is not None:
                self._hosted.stop()
                self._hosted = None
            raise
        if self._in_process_address is not None:
            in_process.register(self._in_process_address, self._open_in_process)
        return self

    def _open_in_process(self, peer: str) -> InProcessLink:
        assert self._store is not None
        return InProcessLink(self._store, peer)

    def wait_for_ps_sessions(self, peers: int, connect_timeout: float) -> bool:
        """Blocks until ``peers`` ps sessions have opened (waiting at most ``connect_timeout``
        seconds for them) and every open one has closed; returns whether ``peers`` opened.

        A worker that serves ps tasks calls it before it exits, once its own requests are
        done: the other workers may still read the rows it serves (an evaluation after
        training), and a worker that is gone closes its sessions.
        """
        with self._ps_sessions:
            opened = self._ps_sessions.wait_for(lambda: self._ps_sessions_opened >= peers, connect_timeout)
            self._ps_sessions.wait_for(lambda: self._ps_sessions_open == 0)
        return opened

    def join(self, timeout: float | None = None) -> bool:
        """Blocks until the coordinator shuts the cluster down; returns whether it did.

        Open sessions are closed and their threads finish their request before this
        returns, so the process can exit without threads still inside torch.
        """
        if not self._server.join(timeout):
            return False
        self._close_sessions()
        if self._hosted is not None:  # the coordinator is done with every ps task
            self._hosted.stop()
        return True

    def _close_sessions(self) -> None:
        """Wakes every open session's thread (its socket is shut down) and waits for them to end.

        A thread still running after ``SESSION_EXIT_WAIT_S`` is named in a warning with its stack:
        if it is inside a torch op when the process exits, Python 3.11's finalisation stops it
        there and the process aborts ("terminate called without an active exception").
        """
        with self._sessions_lock:
            self._sessions_closed = True  # one admitted before the listener closed must not start now
            sessions = dict(self._sessions)
        for channel in sessions.values():
            try:  # wakes a thread blocked in recv: it sees EOF and returns
                sock = socket.socket(fileno=os.dup(channel.connection.fileno()))
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                finally:
                    sock.close()
            except (OSError, ValueError):
                pass
        ends_by = time.monotonic() + SESSION_EXIT_WAIT_S
        for thread in sessions:
            thread.join(max(0.0, ends_by - time.monotonic()))
        stuck = {thread: channel for thread, channel in sessions.items() if thread.is_alive()}
        if stuck:
            frames = sys._current_frames()
            stacks = "\n".join(
                f"session with {channel.peer} ({thread.name}):\n"
                + ("".join(traceback.format_stack(frames[thread.ident])) if thread.ident in frames else "  (ended)\n")
                for thread, channel in stuck.items()
            )
            warnings.warn(
                f"{self._server.name}: {len(stuck)} session(s) still running {SESSION_EXIT_WAIT_S:g} s after the "
                f"cluster stopped; a thread inside a torch op when the process exits aborts it (Python stops "
                f"daemon threads where they are). Their stacks:\n{stacks}",
                RuntimeWarning, stacklevel=3,
            )

    def _track(self, channel: Channel) -> bool:
        """Records this thread's session for ``join`` to close; False (the caller closes the
        channel and serves nothing) once ``join`` has closed the sessions: a thread still
        serving while the process exits can abort it inside torch."""
        with self._sessions_lock:
            if self._sessions_closed:
                return False
            self._sessions[threading.current_thread()] = channel
            return True

    def _untrack(self) -> None:
        with self._sessions_lock:
            self._sessions.pop(threading.current_thread(), None)

    def stop(self) -> None:
        """Stops serving (and the ps tasks this worker serves, if any)."""
        if self._hosted is not None:
            self._hosted.stop()
        if self._in_process_address is not None:
            in_process.unregister(self._in_process_address, self._open_in_process)
        self._server.stop()

    # -- sessions -----------------------------------------------------------------------
    def _ps_session(self, channel: Channel, message: Any) -> None:
        if self._store is None or not self._track(channel):  # no ps here; or join closed the sessions
            channel.close()
            return
        try:
            hello = message[1] if len(message) > 1 else None
            if accept_session(channel, hello):
                self._serve_ps(channel, cast(wire.Hello, hello))  # accept_session takes only a Hello
            else:
                channel.close()
        finally:
            self._untrack()

    def _serve_ps(self, channel: Channel, hello: wire.Hello) -> None:
        """Serves an accepted ps session, counted open (``wait_for_ps_sessions``) while it lasts."""
        assert self._store is not None
        with self._ps_sessions:
            self._ps_sessions_opened += 1
            self._ps_sessions_open += 1
        serve_at_batch_priority()  # this session's thread: its wakeups do not preempt a worker on this host
        try:
            try:
                link = serving_link(channel, hello.replies_apart)
            except (EOFError, OSError):  # the peer went away as the session opened
                channel.close()
                return
            try:
                serve_ps_session(self._store, link)
            finally:
                link.close()  # and its reply socket: a worker waiting on it sees the end
        finally:
            with self._ps_sessions:
                self._ps_sessions_open -= 1
                self._ps_sessions.notify_all()

    def _worker_session(self, channel: Channel, message: Any) -> None:
        """Runs the coordinator's functions, one at a time, until it disconnects."""
        install_step_hooks()
        set_nodelay(channel)
        if not self._track(channel):
            channel.close()
            return
        with self._session_lock:  # one coordinator at a time
            config = message[1]
            client = PSClient(config["ps"], self._authkey, timeout=config["timeout"], shared=ps_shared_memory(),
                              replies_apart=True)
            runtime = RUNTIME.current = WorkerRuntime(client, config["worker_index"])
            try:
                while True:
                    try:
                        request = channel.recv()
                    except (EOFError, OSError):
                        return
                    reply = self._handle(runtime, config, request)
                    try:
                        channel.send(reply)
                    except (EOFError, OSError):
                        return
                    except Exception as e:  # the result could not be pickled
                        channel.send(wire.FunctionFailed(
                            TypeError(f"the function's result could not be pickled: {e!r}"), "", False
                        ))
            finally:
                self._untrack()
                client.close()
                if RUNTIME.current is runtime:
                    RUNTIME.current = None

    def _handle(self, runtime: WorkerRuntime, config: dict, request: Any) -> wire.FunctionResult | wire.FunctionFailed:
        handler = _WORKER_REQUESTS.get(type(request))
        try:
            if handler is None:
                raise wire.ProtocolError(f"malformed worker request {type(request).__name__!r}: expected one of "
                                         f"{sorted(c.__name__ for c in _WORKER_REQUESTS)} of unison._ps.wire.protocol; "
                                         f"is the chief another unison version?")
            return handler(runtime, config, request)
        except Exception as e:  # the coordinator raises it (original type, this traceback)
            return wire.FunctionFailed(e, traceback.format_exc(), isinstance(e, ParameterServerError))


def _build_dataset(runtime: WorkerRuntime, config: dict, request: wire.BuildDataset) -> wire.FunctionResult:
    runtime.datasets[request.dataset_id] = build_dataset(request.dataset_fn, config["worker_index"],
                                                         config["num_workers"])
    return wire.FunctionResult(None)


def _run_function(runtime: WorkerRuntime, config: dict, request: wire.RunFunction) -> wire.FunctionResult:
    runtime.begin()
    fn, args, kwargs = loads_on_worker(request.payload, runtime.resolve)
    runtime.pull_touched()
    try:
        result = fn(*args, **kwargs)
        runtime.client.settle()  # its row pushes are applied before it counts as done
        runtime.push_changes()  # only a function that returned changes the ps variables
        return wire.FunctionResult(result)
    finally:
        runtime.end()


_WORKER_REQUESTS: dict[type, Callable[[WorkerRuntime, dict, Any], wire.FunctionResult]] = {
    wire.BuildDataset: _build_dataset,
    wire.RunFunction: _run_function,
}
"""What a worker task does for each request of the chief's session (one handler per message type)."""


def hosted_ps_indices(num_ps: int, num_workers: int, worker_index: int) -> list[int]:
    """The ps tasks worker ``worker_index`` of ``num_workers`` serves: every ``j % num_workers == worker_index``."""
    return [j for j in range(num_ps) if num_workers and j % num_workers == worker_index]


class HostedPS:
    """The ps tasks this worker serves in its own process, serving from construction on.

    Args:
        jobs: the cluster's jobs (``{"worker": [...], "ps": [...]}``).
        worker_index: this worker's index.
        authkey: the cluster's key.
    """

    def __init__(self, jobs: Mapping[str, Any], worker_index: int, authkey: bytes):
        self.indices = hosted_ps_indices(len(jobs.get("ps", ())), len(jobs.get("worker", ())), worker_index)
        self.servers: list[Server] = []
        try:
            for j in self.indices:
                self.servers.append(Server(dict(jobs), "ps", j, authkey=authkey, in_process=True))
        except BaseException:
            self.stop()
            raise

    @classmethod
    def for_task(cls, jobs: Mapping[str, Any], task_type: str | None, task_index: int | None,
                 authkey: bytes, environ: Mapping[str, str] | None = None) -> HostedPS | None:
        """The ps tasks a ``task_type:task_index`` task serves under ``UNISON_PS_IN_WORKERS=1``; None
        when it serves none (the variable unset, a chief or ps task, a cluster without ps tasks)."""
        if task_type != "worker" or not jobs.get("ps") or not ps_in_workers(environ):
            return None
        hosted = cls(jobs, task_index or 0, authkey)
        return hosted if hosted.servers else None

    def stop_after_peers(self, peers: int, connect_timeout: float) -> None:
        """Serves until ``peers`` other tasks have come and gone from every ps task here, then stops.

        The caller's own requests are done (its client closed); the other workers may still
        read rows here (an evaluation after training). A peer that never comes is given up
        after ``connect_timeout`` seconds in all, with a warning.
        """
        for j, server in zip(self.indices, self.servers):
            if not server.wait_for_ps_sessions(peers, connect_timeout):
                warnings.warn(f"ps:{j}, served by this worker, stopped before all {peers} other tasks reached it "
                              f"(not all came within {connect_timeout:g} s)", RuntimeWarning, stacklevel=2)
        self.stop()

    def stop(self) -> None:
        """Stops serving at once."""
        for server in self.servers:
            server.stop()
