"""Rendezvous between a test and the worker processes it starts.

The parent opens a ``torch.distributed.TCPStore`` server on port 0 (the kernel picks a
free port and the store keeps it bound, so no other process can take it in between) and
passes its address to the workers in ``UNISON_RENDEZVOUS``. The library's multi-worker
strategy connects to that store as a client, under a key prefix of its own; tests that
form a plain process group use :func:`connect_rendezvous_store` or
:func:`init_test_process_group`.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as dist

from unison._cluster import env

__all__ = [
    "RENDEZVOUS_ENV",
    "LOCALHOST",
    "serve_rendezvous",
    "connect_rendezvous_store",
    "init_test_process_group",
    "free_port",
    "as_launched_worker",
]

RENDEZVOUS_ENV = env.UNISON_RENDEZVOUS
"""Environment variable holding the parent store's ``"host:port"`` in every worker."""

LOCALHOST = "127.0.0.1"


def _as_timedelta(timeout: float | timedelta) -> timedelta:
    if isinstance(timeout, timedelta):
        return timeout
    return timedelta(seconds=float(timeout))


@contextmanager
def serve_rendezvous(timeout: float | timedelta) -> Iterator[str]:
    """Runs the rendezvous store server in this process for the duration of a block.

    Args:
        timeout: How long a ``get``/``wait`` on the store may block.

    Yields:
        The store's address, ``"127.0.0.1:PORT"``, for ``UNISON_RENDEZVOUS``. The
        server stops when the block exits: TCPStore has no ``close``, and dropping
        its only reference, held here, stops its listener.
    """
    store = dist.TCPStore(
        LOCALHOST, 0, None, True, _as_timedelta(timeout), wait_for_workers=False
    )
    try:
        yield f"{LOCALHOST}:{store.port}"
    finally:
        del store


def _parse_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(
            f"{RENDEZVOUS_ENV}={text!r} is not a 'host:port' address; "
            f"it is set by unison._testing.run_workers, e.g. '127.0.0.1:29500'"
        )
    return host, int(port)


def connect_rendezvous_store(timeout: float | timedelta = 30.0) -> dist.TCPStore:
    """Connects, as a client, to the store of the test that started this worker.

    Args:
        timeout: Seconds (or a timedelta) to wait for the connection and for each
            blocking store operation.

    Returns:
        A client ``TCPStore``. Wrap it in a ``torch.distributed.PrefixStore`` with a
        prefix of your own before forming a process group on it.

    Raises:
        RuntimeError: ``UNISON_RENDEZVOUS`` is not set (the process was not started by
            ``run_workers`` or ``WorkerPool``).
        ValueError: ``UNISON_RENDEZVOUS`` is not a ``host:port`` address.
    """
    text = env.rendezvous_address()
    if not text:
        raise RuntimeError(
            f"{RENDEZVOUS_ENV} is not set: connect_rendezvous_store() runs inside a "
            "worker started by unison._testing.run_workers or WorkerPool"
        )
    host, port = _parse_address(text)
    return dist.TCPStore(host, port, is_master=False, timeout=_as_timedelta(timeout))


def init_test_process_group(
    rank: int,
    world_size: int,
    *,
    backend: str = "gloo",
    prefix: str = "unison_testing/pg",
    timeout: float = 20.0,
) -> None:
    """Forms the default process group of a worker through the parent's store.

    Keep ``timeout`` below the test's timeout so a hung collective becomes an
    exception in the worker rather than a killed process.

    Args:
        rank: This worker's rank.
        world_size: Number of workers.
        backend: ``torch.distributed`` backend.
        prefix: Store key prefix; use a different one for each group formed on the
            same store.
        timeout: Seconds for the rendezvous and for each collective.
    """
    store = dist.PrefixStore(prefix, connect_rendezvous_store(timeout))
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=_as_timedelta(timeout),
    )


def free_port(host: str = LOCALHOST) -> int:
    """Returns a TCP port that was free a moment ago.

    Only for code paths that need an address *string* (for example a cluster spec
    parsed from ``TF_CONFIG``) and never bind it. The port is released before it is
    returned, so another process may take it: real rendezvous goes through the
    parent's store (``UNISON_RENDEZVOUS``), which keeps its port bound.

    Args:
        host: Address to bind while asking the kernel for a port.

    Returns:
        A port number.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def as_launched_worker(rank: int, world_size: int) -> None:
    """Sets this process's ``TF_CONFIG`` to worker ``rank``'s of ``world_size`` workers on this host, as
    ``unison launch`` would: a script's ``main`` then runs as that worker in a ``run_workers`` process
    (whose store is the rendezvous; the workers' addresses are never bound)."""
    os.environ[env.TF_CONFIG] = json.dumps({"cluster": {"worker": [f"{LOCALHOST}:{i + 1}" for i in range(world_size)]},
                                          "task": {"type": "worker", "index": rank}})
