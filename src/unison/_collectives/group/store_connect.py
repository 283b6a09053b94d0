"""Reaching the rendezvous store and waiting for every task, under one deadline.

Before the workers' process group forms, two waits used to escape ``timeout_seconds``:

- ``torch.distributed.TCPStore``'s constructor, as a client, validates the server with
  a read that has no deadline: a process that accepts connections at the leader's
  address and never answers (another program on the port, a hung leader) held it many
  times its timeout. Its own retries on a refused connection add to the timeout too
  (``benchmarks/RESULTS.md``, 'TCPStore waits beyond their timeout').
- ``init_process_group`` waits for every rank's key, and on timeout names the key
  (``/unison/0//cpu//0/1``), not the task that never came.

So a task first waits, in its own thread and within the deadline, until something
accepts a plain TCP connection at the store's address: while nothing listens no helper
thread exists, so none is left behind when the error comes. Only then is the store
constructed, in a helper thread joined with what is left of the deadline (the
constructor releases the GIL) and given that much as its own timeout; an open TCP port
proves nothing about the protocol, and checking it ourselves would mean speaking
TCPStore's private wire protocol. No helper outlives the deadline into interpreter
shutdown, where a constructor still running aborts the process (``terminate called
without an active exception``, status 134, in about 1 run in 10 after a caught error):
one stuck reading an answer past the deadline has its connection shut down (Linux) and
is joined, and one still inside TCPStore's own connect retries is joined at exit, for
as long as those retries can last. Then every task announces its arrival under its
name, and the wait for the others uses what is left of the same deadline; when it runs
out the error names the tasks that never arrived and the store's address.

Two runs can be given one port on a shared node (a fixed port, or the same
``MASTER_PORT``): the store's host then writes its run's token (``slurm-job<id>-step<id>``
under SLURM) to ``OWNER_KEY``, every other task checks it before announcing itself, and
the arrival keys carry the token, so a task of another run stops with an error naming
both runs instead of joining. A leader host name that does not resolve is named at once
instead of after the timeout.

tf.distribute equivalent: the collective leader's rendezvous of
``CollectiveAllReduceStrategy``, which times out with the names of missing tasks.
"""

from __future__ import annotations

import atexit
import datetime
import os
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from unison.errors import ClusterError

__all__ = ["ARRIVAL_PREFIX", "OWNER_KEY", "join_rendezvous"]

#: Keys ``ARRIVAL_PREFIX + token/ + str(rank)`` on the raw store hold each arrived task's name.
ARRIVAL_PREFIX = "unison-arrived/"

#: The key where the store's host writes the rendezvous token of its run; a task of
#: another run that reaches the store (a port clash on a shared node) reads a different
#: token and stops with an error instead of joining.
OWNER_KEY = "unison-owner"


def join_rendezvous(
    host: str,
    port: int,
    *,
    is_master: bool,
    rank: int,
    names: Sequence[str],
    timeout: datetime.timedelta | float,
    token: str | None = None,
) -> dist.Store:
    """Connects to (or, as the leader, hosts) the store and waits until every task arrived.

    Args:
        host, port: the store's address.
        is_master: whether this process hosts the store (binding ``port``).
        rank: this task's rank; ``names[rank]`` is its name.
        names: every task's name by rank, e.g. ``["worker:0", "worker:1"]``.
        timeout: the one deadline for connecting and for every arrival.
        token: the run's rendezvous token (``ResolvedCluster.rendezvous_token``): the
            host writes it to ``OWNER_KEY`` and the others check it, and it names the
            arrival keys. None for a store opened by someone else (no owner check).

    Returns:
        The store, on which every task has arrived.

    Raises:
        ClusterError: if the store's host name does not resolve, the store cannot be
            reached, answers nothing, belongs to another run, or a task does not arrive
            before the deadline; the message names the address and the missing tasks.
    """
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    deadline = time.monotonic() + seconds
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    me = names[rank]
    what = f"{me} {'hosting' if is_master else 'reaching'} the rendezvous store at {address}"
    if not is_master:
        _check_resolves(host, port, what)
    store = _construct(host, port, len(names), is_master, seconds, deadline, what)
    if token is not None:
        if is_master:
            store.set(OWNER_KEY, token)
        else:
            _check_owner(store, token, deadline, seconds, what, names[0])
    prefix = f"{ARRIVAL_PREFIX}{token}/" if token else ARRIVAL_PREFIX
    store.set(f"{prefix}{rank}", me)
    _wait_for_everyone(store, names, deadline, seconds, me, address, prefix)
    return store


def _check_resolves(host: str, port: int, what: str) -> None:
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ClusterError(
            f"{what}: the host name {host!r} does not resolve on this machine ({exc.strerror}); set MASTER_ADDR "
            f"to the leader's IP address (under SLURM it replaces the first node's name), or fix the leader's "
            f"address in the cluster spec"
        ) from exc


def _check_owner(store: dist.Store, token: str, deadline: float, seconds: float, what: str, leader: str) -> None:
    try:
        store.wait([OWNER_KEY], datetime.timedelta(seconds=max(0.001, deadline - time.monotonic())))
        owner = store.get(OWNER_KEY).decode("utf-8", "replace")
    except Exception as exc:  # noqa: BLE001 - a timeout: the host never said whose store it is
        raise ClusterError(
            f"{what}: the store's host never said which run it belongs to within timeout_seconds={seconds:g} "
            f"({leader} is not hosting it); another program's store may hold the port: free it, or give this "
            f"run another port (MASTER_PORT)"
        ) from exc
    if owner != token:
        raise ClusterError(
            f"{what}: the store there belongs to another run ({owner or 'a run with no token'!r}), not to this "
            f"one ({token or 'no token'!r}); two runs were given the same port on one host. Give this run "
            f"another port (MASTER_PORT, or a different job step under SLURM) and start it again"
        )


# Pause between plain connection attempts while nothing listens at the store's address.
_PROBE_INTERVAL_S = 0.05
# How long a helper whose connection was shut down gets to end before being left to atexit.
_RELEASE_JOIN_S = 2.0
# TCPStore's own connect retries (with backoff) last up to about this many times its timeout
# (benchmarks/RESULTS.md, 'TCPStore waits beyond their timeout'); a lingering helper is
# joined at exit that long.
_CONSTRUCTOR_SPAN_FACTOR = 3.0

# Helpers still inside TCPStore's constructor after their deadline, with the monotonic
# time by which its own retries end; joined at exit (``_join_lingering``).
_lingering: dict[threading.Thread, float] = {}
_lingering_lock = threading.Lock()


def _construct(
    host: str, port: int, world_size: int, is_master: bool, seconds: float, deadline: float, what: str
) -> dist.Store:
    if not is_master and not _await_listener(host, port, deadline):
        raise ClusterError(
            f"{what} got no connection within timeout_seconds={seconds:g}: nothing listens at that address; "
            f"start the collective leader, or fix its address in the cluster spec"
        )
    outcome: dict[str, Any] = {}
    budget = max(0.001, deadline - time.monotonic())

    def construct() -> None:
        try:
            store = dist.TCPStore(
                host, port, world_size, is_master=is_master, timeout=datetime.timedelta(seconds=budget),
                wait_for_workers=False,
            )
            store.set_timeout(datetime.timedelta(seconds=seconds))  # later waits default to the whole timeout
            outcome["store"] = store
        except Exception as exc:  # noqa: BLE001 - reported by the caller, in the cluster's words
            outcome["error"] = exc

    before = _socket_fds()
    started = time.monotonic()
    helper = threading.Thread(target=construct, name="unison-store-connect", daemon=True)
    helper.start()
    helper.join(max(0.0, deadline - time.monotonic()))
    if "store" in outcome:
        return outcome["store"]
    if "error" in outcome:
        raise ClusterError(
            f"{what} failed within timeout_seconds={seconds:g}: {outcome['error']}; check that the collective "
            f"leader is running and that its address in the cluster spec is right and free"
        ) from outcome["error"]
    _release(helper, host, port, before, started + _CONSTRUCTOR_SPAN_FACTOR * budget + _RELEASE_JOIN_S)
    raise ClusterError(
        f"{what} got no answer within timeout_seconds={seconds:g}: something accepts connections at that "
        f"address but does not answer as a torch.distributed store (another program on the port, or a hung "
        f"leader); free the port or fix the leader's address in the cluster spec"
    )


def _await_listener(host: str, port: int, deadline: float) -> bool:
    """Whether something accepts a plain TCP connection at the address before the deadline.

    Refused or unreachable attempts are repeated until then, in the caller's thread, so a
    missing leader leaves no thread behind (TCPStore's constructor would keep retrying
    past the deadline, and abort the process if still running at exit).
    """
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        try:
            socket.create_connection((host, port), timeout=remaining).close()
            return True
        except OSError:
            pass  # refused (nothing listens yet), unreachable, or timed out: try again until the deadline
        time.sleep(min(_PROBE_INTERVAL_S, max(0.0, deadline - time.monotonic())))


def _socket_fds() -> set[int] | None:
    """This process's open socket descriptors, or None where /proc/self/fd is not there."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return None
    fds = set()
    for name in names:
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                fds.add(int(name))
        except (OSError, ValueError):
            continue  # closed meanwhile (the listing's own descriptor, for one)
    return fds


def _release(helper: threading.Thread, host: str, port: int, before: set[int] | None, ends_by: float) -> None:
    """Ends a helper stuck in TCPStore's constructor past the deadline, or joins it at exit.

    Its connection is found among the sockets opened since it started (connected to the
    store's address) and shut down, so its read returns and it ends with an error now; a
    helper that is not reading (inside TCPStore's own connect retries) is joined at
    interpreter exit, for as long as those retries can last.
    """
    after = _socket_fds()
    if before is not None and after is not None:
        try:
            peers = {info[4][:2] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)}
        except OSError:
            peers = set()
        for fd in sorted(after - before):
            _shut_down_if_connected_to(fd, peers)
        helper.join(_RELEASE_JOIN_S)
    if helper.is_alive():
        with _lingering_lock:
            _lingering[helper] = ends_by


def _shut_down_if_connected_to(fd: int, peers: set[tuple[Any, ...]]) -> None:
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return  # closed meanwhile, or not a socket after all
    with sock:
        try:
            peer = sock.getpeername()
        except OSError:
            return  # not connected
        # An IPv4 peer may be reported as IPv4-mapped IPv6 on a dual-stack socket.
        address = peer[0].removeprefix("::ffff:") if isinstance(peer, tuple) else None
        if address is not None and any(address == p[0].removeprefix("::ffff:") and peer[1] == p[1] for p in peers):
            try:
                sock.shutdown(socket.SHUT_RDWR)  # acts on the shared socket: the helper's read returns
            except OSError:
                pass


@atexit.register
def _join_lingering() -> None:
    """Joins helpers still in TCPStore's constructor before the interpreter finalises,
    each until its own retries end: one still running at shutdown aborts the process."""
    with _lingering_lock:
        lingering = list(_lingering.items())
        _lingering.clear()
    for helper, ends_by in lingering:
        helper.join(max(0.0, ends_by - time.monotonic()))


def _wait_for_everyone(store: dist.Store, names: Sequence[str], deadline: float, seconds: float, me: str, address: str,
                       prefix: str = ARRIVAL_PREFIX) -> None:
    keys = [f"{prefix}{rank}" for rank in range(len(names))]
    remaining = deadline - time.monotonic()
    if remaining > 0:
        try:
            store.wait(keys, datetime.timedelta(seconds=remaining))
            return
        except Exception:  # noqa: BLE001 - a timeout (DistStoreError); found out below which keys
            pass
    try:
        missing = [name for name, key in zip(names, keys) if not store.check([key])]
    except Exception as exc:  # noqa: BLE001 - the store itself went away
        raise ClusterError(
            f"{me}: the rendezvous store at {address} stopped answering while tasks arrived ({exc}); "
            f"check that the collective leader is still running"
        ) from exc
    if not missing:
        return  # everyone arrived just as the deadline passed
    raise ClusterError(
        f"{me}: task(s) {', '.join(missing)} never arrived at the rendezvous store at {address} within "
        f"timeout_seconds={seconds:g} ({len(names) - len(missing)} of {len(names)} did); start them, or "
        f"check that their cluster spec names this leader address"
    )
