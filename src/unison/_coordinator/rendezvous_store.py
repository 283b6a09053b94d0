"""Coordination of an INDEPENDENT_WORKER cluster through a TCPStore on the leader.

In INDEPENDENT_WORKER mode there is no client to relay messages, so the collective
leader (the chief, else worker 0) hosts a ``torch.distributed.TCPStore`` and every
chief, worker and ps task connects to it. It gives three things:

* the worker barrier of ``WorkerContext.wait_for_other_workers``;
* the end-of-run check-out: the leader waits until every worker finished
  ``worker_fn``;
* the stop signal for tasks that only serve (ps tasks, and non-chief workers under
  in-graph replication): they wait until the leader says stop, acknowledge, and exit.

Port: the store listens on the leader's *host* at ``UNISON_COORDINATOR_PORT`` when it
is set (``unison launch`` sets it to a free port), else at the leader's cluster port
+ 1. The leader's own cluster port is left alone: it is where a multi-worker strategy
forms its process group. The store binds the leader's address only, not every
interface; like torch.distributed's own store it carries no key, and nothing read from
it is executed (it holds counters and flags).
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # exported at run time only

from unison._cluster import env, multi_worker_util
from unison._cluster.spec import ClusterSpec, split_address
from unison.errors import ClusterError

__all__ = ["coordination_address", "StoreCoordination"]

_PREFIX = "unison/coordinator/"
_OK = b"ok"
_FAILED = b"failed:"


def coordination_address(cluster_spec: ClusterSpec, environ: Mapping[str, str] | None = None) -> tuple[str, int]:
    """``(host, port)`` of the INDEPENDENT_WORKER coordination store.

    Raises:
        ValueError: if ``UNISON_COORDINATOR_PORT`` is malformed, or the leader's port is
            65535 and no port is set.
    """
    job, index = multi_worker_util.leader_task(cluster_spec)
    host, leader_port = split_address(cluster_spec.task_address(job, index))
    port = env.coordinator_port(environ)
    if port is not None:
        return host, port
    if leader_port == 65535:
        raise ValueError(
            f"the leader {job}:{index} uses port 65535, so port + 1 is not available for coordination; "
            f"set {env.UNISON_COORDINATOR_PORT}"
        )
    return host, leader_port + 1


class StoreCoordination:
    """One task's handle on the coordination store. Build it with ``open``.

    Args:
        store: the connected TCPStore.
        address: ``"host:port"`` of the store, for messages.
        is_host: whether this task hosts the store (the leader).
        num_workers: tasks that run ``worker_fn`` and pass the barrier.
        num_servers: tasks that only serve until stopped.
        timeout: seconds a barrier or the leader's final wait may take.
    """

    def __init__(self, store: Any, address: str, *, is_host: bool, num_workers: int, num_servers: int, timeout: float):
        self._store = store
        self._address = address
        self._is_host = is_host
        self._num_workers = num_workers
        self._num_servers = num_servers
        self._timeout = timeout
        self._generation = 0

    @classmethod
    def open(
        cls,
        cluster_spec: ClusterSpec,
        task_type: str,
        task_id: int,
        *,
        num_workers: int,
        num_servers: int,
        timeout: float,
        environ: Mapping[str, str] | None = None,
    ) -> StoreCoordination:
        """Hosts (on the leader) or joins (elsewhere) the cluster's coordination store.

        Raises:
            ClusterError: if the leader cannot bind the port, or another task cannot reach
                the leader within ``timeout`` seconds.
        """
        host, port = coordination_address(cluster_spec, environ)
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        is_host = (task_type, task_id) == multi_worker_util.leader_task(cluster_spec)
        wait = datetime.timedelta(seconds=timeout)
        if is_host:
            listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                listener.bind((host, port))
                listener.listen(128)
            except OSError as e:
                listener.close()
                raise ClusterError(
                    f"the leader {task_type}:{task_id} cannot host the coordination store at {address} ({e}); "
                    f"set {env.UNISON_COORDINATOR_PORT} to a free port on every task"
                ) from e
            fd = os.dup(listener.fileno())  # the store takes ownership of this descriptor
            listener.close()
            store = TCPStore(host, port, None, True, wait, wait_for_workers=False, master_listen_fd=fd)
        else:
            try:
                store = TCPStore(host, port, None, False, wait)
            except dist.DistError as e:
                raise ClusterError(
                    f"{task_type}:{task_id} could not reach the coordination store of the leader at "
                    f"{address} within {timeout:g} s; is the leader running, and "
                    f"{env.UNISON_COORDINATOR_PORT} the same on every task?"
                ) from e
        return cls(store, address, is_host=is_host, num_workers=num_workers, num_servers=num_servers, timeout=timeout)

    def _wait(
        self, key: str, what: str, count_key: str | None = None, expected: int = 0, *, forever: bool = False
    ) -> None:
        """Waits for ``key`` to be set: "ok" goes on, "failed:<task>" raises.

        One blocking wait, no polling: ``abort`` sets every key another task can be
        waiting on, so a failure wakes everyone at once.
        """
        timeout = datetime.timedelta(days=3650) if forever else datetime.timedelta(seconds=self._timeout)
        try:
            self._store.wait([_PREFIX + key], timeout)
            value = self._store.get(_PREFIX + key)
        except dist.DistNetworkError as e:
            raise ClusterError(
                f"lost the coordination store at {self._address} during {what}: the leader task stopped"
            ) from e
        except dist.DistStoreError as e:
            arrived = self._store.add(_PREFIX + count_key, 0) if count_key else "?"
            raise ClusterError(
                f"{what} timed out after {self._timeout:g} s: {arrived} of {expected} tasks arrived "
                f"(store {self._address}); a task is stuck or gone"
            ) from e
        if value.startswith(_FAILED):
            raise ClusterError(f"stopped {what}: task {value[len(_FAILED):].decode()} failed")

    def wait(self) -> None:
        """The worker barrier: returns once all ``num_workers`` workers called it.

        Raises:
            ClusterError: if a task failed, on timeout, or if the leader is gone.
        """
        self._generation += 1
        key = f"barrier/{self._generation}"
        if self._store.add(_PREFIX + key, 1) == self._num_workers:
            self._store.set(_PREFIX + key + "/open", _OK)
        self._wait(key + "/open", f"worker barrier #{self._generation}", key, self._num_workers)

    def check_out(self) -> None:
        """Marks this worker done. The leader then waits for every worker, stops the
        serving tasks, waits for their acknowledgement, and closes the store."""
        try:
            if self._store.add(_PREFIX + "exited", 1) == self._num_workers:
                self._store.set(_PREFIX + "exited/all", _OK)
            if self._is_host:
                self._wait("exited/all", "waiting for every worker to finish", "exited", self._num_workers)
                if self._num_servers:
                    self._store.set(_PREFIX + "stop", _OK)
                    self._wait("stopped/all", "waiting for the serving tasks to stop", "stopped", self._num_servers)
        finally:
            self.close()

    def abort(self, task: str) -> None:
        """Tells every task that ``task`` failed, then closes.

        Sets each key another task can be waiting on to ``failed:<task>``: this task's
        current and next barrier (no one can be further ahead, since they all need this
        task to pass), the leader's wait for the workers, and the serving tasks' stop.
        """
        failed = _FAILED + task.encode()
        barriers = [f"barrier/{g}/open" for g in (self._generation, self._generation + 1) if g > 0]
        try:
            for key in (*barriers, "exited/all", "stop"):
                self._store.set(_PREFIX + key, failed)
        except dist.DistError:
            pass  # the store is gone already: the others notice that instead
        finally:
            self.close()

    def serve_until_stopped(self) -> None:
        """Blocks until the leader says stop, then acknowledges and closes.

        Raises:
            ClusterError: if a task failed or the leader is gone before saying stop.
        """
        try:
            self._wait("stop", "serving", forever=True)
            if self._store.add(_PREFIX + "stopped", 1) == self._num_servers:
                self._store.set(_PREFIX + "stopped/all", _OK)
        finally:
            self.close()

    def close(self) -> None:
        """Drops this task's connection (on the leader: shuts the store down)."""
        self._store = None
