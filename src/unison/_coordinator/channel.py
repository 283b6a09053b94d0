"""The coordinator's control channel: authenticated connections that carry pickles.

A standalone client sends functions to standard servers, and unpickling is running
code, so every connection first proves that both ends hold the cluster's key: the
HMAC challenge of ``multiprocessing.connection`` (``deliver_challenge`` /
``answer_challenge``, run by ``unison._coordinator.handshake``), exchanged as raw bytes,
before a single pickle is read. A peer without the key is dropped; a peer that says
nothing (or drips bytes) is dropped at a deadline on its whole handshake, and either
way only its own handshake thread ever waited for it. At most ``MAX_HANDSHAKES`` such
threads exist per listener, fewer where the free file descriptors carry fewer (see
``unison._coordinator.admission``). A client's ``connect(timeout=...)`` bounds its whole
handshake too, and says which end gave up.

The key comes from ``UNISON_AUTHKEY`` (hex) or ``UNISON_AUTHKEY_FILE`` (a file holding
the hex), which ``unison launch`` fills with a fresh random key per cluster.

On Linux a listener also accepts on an abstract Unix socket named after the address it
bound (``local_socket_name``). A peer on the same host that asks for it
(``connect(..., same_host_first=True)``: a worker's links to ps tasks) skips the TCP/IP
stack, which the lookups, pushes and replies of a hybrid DLRM cross six times a step
(2-3% less CPU a step, ``benchmarks/RESULTS.md``). The same handshake guards it; a peer on
another host (or in another network namespace) cannot see the name, and connects over TCP.
A Unix socket's default send buffer (208 KB) is smaller than a ps task's reply to a 256 KB
row pull, where TCP's grows to 4 MB: the tensor links widen theirs
(``unison._ps.wire.links.widen_send_buffer``; without it a ParameterServerStrategy job looking
rows up in two ps tasks ran 0.88x its speed over TCP, RESULTS, issue 45), and such a job's links
take the replies on a socket of their own (``unison._ps.wire.links.open_link``).
"""

from __future__ import annotations

import errno
import logging
import pickle
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from multiprocessing import AuthenticationError as _MpAuthenticationError
from multiprocessing.connection import Connection
from typing import Any

import cloudpickle

from unison._cluster import env
from unison._cluster.env import MIN_KEY_BYTES, read_authkey
from unison._cluster.spec import split_address
from unison._coordinator.admission import (
    DESCRIPTORS_PER_HANDSHAKE,
    PendingHandshakes,
    descriptor_usage,
    handshake_budget,
)
from unison._coordinator.handshake import HandshakeCut, duplicate_connection, guarded_handshake
from unison.errors import AuthenticationError, ClusterError

__all__ = [
    "MIN_KEY_BYTES",
    "HANDSHAKE_SECONDS",
    "MAX_HANDSHAKES",
    "generate_authkey",
    "read_authkey",
    "require_authkey",
    "Channel",
    "ChannelListener",
    "connect",
]

logger = logging.getLogger(__name__)

#: Deadline of a whole key handshake, in seconds (``unison server --handshake-timeout``).
HANDSHAKE_SECONDS = 10.0
#: Most key handshakes under way at once on one listener (2 descriptors and a thread each).
MAX_HANDSHAKES = 64
# The least a client's handshake is given when it starts late in its connect timeout.
_LATE_HANDSHAKE_SECONDS = 1.0
# Back-off of the accept loop while the process has no descriptor or thread to spare.
_BACKOFF_FIRST, _BACKOFF_LAST = 0.05, 1.0
# accept() errors that mean the process (or system) has no descriptor or buffer to spare.
_DESCRIPTOR_ACCEPT_ERRORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
# How long accepting must go without a failure before an overload episode may end.
_CALM_SECONDS = 1.0
# How long close() waits for an accept loop to leave accept() (and its socket to be freed).
_ACCEPT_EXIT_WAIT = 2.0
# How long the accept loop waits for cut handshakes to close their sockets before accepting.
_CUT_CLOSE_WAIT = 1.0
# accept() errors that concern only the connection being accepted (see accept(2)).
_TRANSIENT_ACCEPT_ERRORS = frozenset(
    {errno.ECONNABORTED, errno.EPROTO, errno.EINTR, errno.EPERM, errno.ENOPROTOOPT, errno.EHOSTDOWN,
     errno.ENONET, errno.EHOSTUNREACH, errno.EOPNOTSUPP, errno.ENETUNREACH, errno.ENETDOWN}
)


def generate_authkey() -> bytes:
    """A fresh random 32-byte key for one cluster."""
    return secrets.token_bytes(32)


def require_authkey(authkey: bytes | None = None, environ: Mapping[str, str] | None = None) -> bytes:
    """``authkey`` if given, else the environment's key.

    Raises:
        ValueError: if there is no key, or it is too short.
        TypeError: if ``authkey`` is not bytes.
    """
    if authkey is None:
        authkey = read_authkey(environ)
    if authkey is None:
        raise ValueError(
            f"the coordinator's control channel needs the cluster's key: set {env.UNISON_AUTHKEY} "
            f"(hex) or {env.UNISON_AUTHKEY_FILE} on every task and the client (`unison launch` does this)"
        )
    if not isinstance(authkey, bytes):
        raise TypeError(f"authkey must be bytes, got {type(authkey).__name__}")
    if len(authkey) < MIN_KEY_BYTES:
        raise ValueError(f"authkey must be at least {MIN_KEY_BYTES} bytes, got {len(authkey)}")
    return authkey


class Channel:
    """An authenticated connection that sends objects with cloudpickle.

    cloudpickle carries functions defined in ``__main__``, closures and lambdas by
    value; functions of importable modules travel by reference and must be importable
    at the other end.
    """

    def __init__(self, connection: Connection, peer: str):
        self._connection = connection
        self.peer = peer
        self._send_lock = threading.Lock()

    @property
    def connection(self) -> Connection:
        """The authenticated connection underneath, for transports that send raw frames on it
        (the parameter-server tensor links)."""
        return self._connection

    def send(self, message: Any) -> None:
        """Pickles ``message`` first (so a pickling error sends nothing), then sends it."""
        data = cloudpickle.dumps(message)
        with self._send_lock:
            self._connection.send_bytes(data)

    def recv(self) -> Any:
        """The next message.

        Raises:
            EOFError: when the peer closed the connection.
            ClusterError: if the message cannot be unpickled here (e.g. a module that
                only the sender can import).
        """
        data = self._connection.recv_bytes()
        try:
            return pickle.loads(data)
        except Exception as e:
            raise ClusterError(f"a message from {self.peer} could not be unpickled here: {e!r}") from e

    def close(self) -> None:
        """Closes the connection."""
        self._connection.close()


def local_socket_name(host: str, port: int) -> str | None:
    """The abstract Unix socket a listener bound to ``host:port`` also accepts on; None where
    there are none (not Linux). Abstract names live in a network namespace: only peers on the
    same host (and in the same namespace) reach one."""
    if not sys.platform.startswith("linux"):
        return None
    return f"\0unison-channel-{host}:{port}"


def _listen_locally(host: str, port: int) -> socket.socket | None:
    """A socket listening on ``local_socket_name(host, port)``; None where none can be made (the
    TCP address still serves every peer)."""
    name = local_socket_name(host, port)
    if name is None:
        return None
    local = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        local.bind(name)
        local.listen(64)
    except OSError as e:
        local.close()
        logger.debug("no same-host socket for %s:%s (%s)", host, port, e)
        return None
    return local


def _connect_locally(host: str, port: int) -> socket.socket | None:
    """A socket connected to the listener of ``host:port`` by its same-host name; None where this
    host has none (another host's address, a listener not started yet, not Linux)."""
    name = local_socket_name(host, port)
    if name is None:
        return None
    local = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        local.connect(name)
    except OSError:
        local.close()
        return None
    return local


def _bind_target(address: str) -> tuple[str, int]:
    """Like split_address, but port 0 (any free port) is allowed."""
    if address.endswith(":0"):
        return split_address(address[:-1] + "1", field="bind address")[0], 0
    return split_address(address, field="bind address")


class _Overload:
    """Episodes in which a listener cannot accept as it should: one warning at the start of
    each, one note at its end.

    An episode lasts until an accept finds room to spare (see ``ChannelListener._make_room``),
    not merely until one accept succeeds, so a flood that keeps the descriptors short is
    one episode however often single accepts get through.
    """

    def __init__(self, address: str, handshakes: PendingHandshakes):
        self._address, self._handshakes = address, handshakes
        self._active = False
        self._shed_before = 0

    def begin(self, what: str, exc_info: bool = False) -> None:
        """Warns that accepting is in trouble (``what``: how and what the listener does), once."""
        if self._active:
            return
        self._active = True
        self._shed_before = self._handshakes.shed
        logger.warning(
            "the control channel at %s cannot accept a connection %s (%d handshakes under way; logged "
            "once until it recovers). Raise the file-descriptor limit (`ulimit -n`) if this was no flood",
            self._address, what, len(self._handshakes), exc_info=exc_info,
        )  # fmt: skip

    def end(self) -> None:
        """Notes that the trouble is over, if there was any."""
        if not self._active:
            return
        self._active = False
        logger.info(
            "the control channel at %s accepts connections again (%d unauthenticated peers dropped for "
            "lack of descriptors meanwhile)", self._address, self._handshakes.shed - self._shed_before,
        )  # fmt: skip


class ChannelListener:
    """Listens on one address and hands authenticated Channels to ``handler``.

    Each accepted socket is authenticated in its own thread, so a slow or silent peer
    never blocks other clients. A peer that fails the handshake is closed and counted
    in ``refused``; nothing it sent is unpickled. Peers that do not prove the key cannot
    take the server down: at most ``max_handshakes`` handshakes are under way at once,
    and no more than half of the file descriptors the process has free can carry (a new
    one shuts the oldest down), each is cut ``handshake_seconds`` after it was accepted
    however slowly its peer drips bytes, and when the process runs short of descriptors
    or threads the listener logs one warning per episode, sheds the oldest peers or backs
    off, and keeps accepting.

    Args:
        address: ``"host:port"`` to bind (port 0 picks a free port; see ``address``).
        authkey: the cluster's key.
        handler: called in a new thread with each authenticated Channel.
        handshake_seconds: deadline of a whole handshake.
        max_handshakes: most handshakes under way at once.

    Attributes:
        address: the ``"host:port"`` actually bound.
        refused: how many peers failed the handshake so far (wrong key, closed, cut).
        handshakes: the handshakes under way (``timed_out`` and ``evicted`` count cuts).

    Raises:
        ClusterError: if the address cannot be bound.
    """

    def __init__(
        self,
        address: str,
        authkey: bytes,
        handler: Callable[[Channel], None],
        *,
        handshake_seconds: float = HANDSHAKE_SECONDS,
        max_handshakes: int = MAX_HANDSHAKES,
    ):
        host, port = _bind_target(address)
        self._authkey = require_authkey(authkey)
        self._handler = handler
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._local: socket.socket | None = None  # the same-host socket, where there is one
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._socket.bind((host, port))
            bound_host, bound_port = self._socket.getsockname()[:2]
            # before the TCP socket listens: a peer that reaches it finds the same-host one too
            self._local = _listen_locally(bound_host, bound_port)
            self._socket.listen(64)
        except OSError as e:
            self._socket.close()
            if self._local is not None:
                self._local.close()
            raise ClusterError(f"cannot listen on {address!r} ({e}); free the port or fix the task's address") from e
        self.address = f"[{bound_host}]:{bound_port}" if ":" in bound_host else f"{bound_host}:{bound_port}"
        self.refused = 0
        self.handshakes = PendingHandshakes(max_handshakes, handshake_seconds, name=self.address)
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._overload = _Overload(self.address, self.handshakes)
        self._thread = threading.Thread(target=self._accept_loop, args=(self._socket,),
                                        name=f"unison-listener-{self.address}", daemon=True)
        self._thread.start()
        self._accepting = [self._thread]
        if self._local is not None:
            local_thread = threading.Thread(target=self._accept_loop, args=(self._local,),
                                            name=f"unison-listener-{self.address}-same-host", daemon=True)
            local_thread.start()
            self._accepting.append(local_thread)

    def _accept_loop(self, listening: socket.socket) -> None:
        try:
            self._accept_until_closed(listening)
        except BaseException:  # SystemExit and the like: say so, never stop accepting silently
            if not self._closed.is_set():
                logger.exception("the control channel at %s stopped accepting connections", self.address)
            raise

    def _accept_until_closed(self, listening: socket.socket) -> None:
        backoff, troubled_at = _BACKOFF_FIRST, -float("inf")  # the last failed accept
        while not self._closed.is_set():
            idle = len(self.handshakes) == 0
            roomy = self._make_room()
            try:
                sock, peer = listening.accept()
                token = self.handshakes.admit(sock)
                try:
                    connection = duplicate_connection(sock)
                except OSError:
                    self.handshakes.release(token, sock)
                    raise
                name = f"a same-host peer of {self.address}" if listening is self._local else f"{peer[0]}:{peer[1]}"
                try:
                    threading.Thread(target=self._admit, args=(sock, connection, name, token), daemon=True).start()
                except RuntimeError:  # "can't start new thread": the same starvation as EMFILE
                    connection.close()
                    self.handshakes.release(token, sock)
                    raise OSError(errno.EAGAIN, "cannot start a handshake thread") from None
            except Exception as e:  # noqa: BLE001 - whatever it is, the listener must go on
                if self._closed.is_set():
                    return
                if isinstance(e, OSError) and e.errno in _TRANSIENT_ACCEPT_ERRORS:
                    continue  # that one connection failed; the listener is fine
                troubled_at = time.monotonic()
                if (
                    isinstance(e, OSError)
                    and e.errno in _DESCRIPTOR_ACCEPT_ERRORS
                    and self.handshakes.shed_to(len(self.handshakes) - 1)
                ):
                    self._overload.begin(f"({e}): dropped the oldest unauthenticated peer to retry")
                    self._await_cut_sockets_closed()
                    continue
                self._overload.begin(f"({e}): backing off and retrying", exc_info=not isinstance(e, OSError))
                self._closed.wait(backoff)
                backoff = min(backoff * 2, _BACKOFF_LAST)
                continue
            # An episode ends at an accept with room to spare and no failure for a while, not
            # at any that gets through (a flood lets single ones through): one warning per flood.
            if idle or (roomy and time.monotonic() - troubled_at > _CALM_SECONDS):
                self._overload.end()
            backoff = _BACKOFF_FIRST

    def _make_room(self) -> bool:
        """Before an accept: drops the oldest handshakes that the free descriptors cannot carry.

        Returns whether there is room to spare: the new connection fits in half of what
        the descriptors allow, so an overload episode may end. Where they cannot be
        counted, never: there an episode ends when no handshake is left under way.
        """
        usage = descriptor_usage()
        if usage is None:
            return False
        held, limit = usage
        pending, closing = len(self.handshakes), self.handshakes.closing
        budget = handshake_budget(limit - held, DESCRIPTORS_PER_HANDSHAKE * (pending + closing))
        if budget >= self.handshakes.limit or pending < budget:  # the new one fits (or admit evicts)
            return pending + 1 <= budget // 2
        self._overload.begin(
            f"without dropping another: {limit - held} of its {limit} file descriptors are free, room "
            f"for {budget} handshakes; dropping the oldest unauthenticated peers so that key holders get in"
        )
        self.handshakes.shed_to(budget - 1)
        return False

    def _await_cut_sockets_closed(self) -> None:
        """Gives the threads of cut handshakes a moment to close their sockets (frees descriptors)."""
        deadline = time.monotonic() + _CUT_CLOSE_WAIT
        while self.handshakes.closing and time.monotonic() < deadline and not self._closed.is_set():
            time.sleep(0.002)

    def _admit(self, sock: socket.socket, connection: Connection, name: str, token: int) -> None:
        try:
            connection = guarded_handshake(sock, connection, token, self._authkey, self.handshakes, server=True)
        except (_MpAuthenticationError, OSError, EOFError):
            with self._lock:
                self.refused += 1
            return
        self._handler(Channel(connection, name))

    def close(self) -> None:
        """Stops accepting connections and cuts handshakes under way (open Channels stay open)."""
        self._closed.set()
        for listening in (self._socket, self._local):
            if listening is None:
                continue
            try:
                listening.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            listening.close()
        # A socket blocked in accept() keeps its address until that call returns: wait for the
        # accept loops, so that the same-host name (and the port) can be bound again at once.
        for thread in self._accepting:
            if thread is not threading.current_thread():
                thread.join(_ACCEPT_EXIT_WAIT)
        self.handshakes.close()


def connect(address: str, authkey: bytes, timeout: float = 60.0, *, same_host_first: bool = False) -> Channel:
    """Connects to a ChannelListener at ``address``, retrying until it is up.

    ``timeout`` bounds the whole call: reaching the server and the key handshake. A
    handshake that starts late in it still gets ``min(timeout, 1 s)``, so a server that
    came up at the last moment is not given up on after a few milliseconds.
    ``same_host_first``: try the listener's same-host Unix socket (``local_socket_name``)
    before TCP, for a connection that carries bulk traffic (a worker's ps links).

    Raises:
        AuthenticationError: if the server does not accept the key (or does not hold it).
        ClusterError: if nothing accepts at ``address`` within ``timeout`` seconds, or the
            server does not finish the handshake within it (overloaded, or no unison
            server), or closes the connection before judging the key.
    """
    host, port = split_address(address)
    deadline = time.monotonic() + timeout
    delay = 0.02
    while True:
        sock = _connect_locally(host, port) if same_host_first else None
        if sock is not None:
            break
        try:
            sock = socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic()))
            break
        except OSError as e:
            if time.monotonic() + delay > deadline:
                raise ClusterError(
                    f"no standard server answered at {address!r} within {timeout:g} s ({e}); "
                    f"start it (`unison server` with that task's TF_CONFIG) or fix the cluster spec"
                ) from e
            time.sleep(delay)  # the server may still be starting
            delay = min(delay * 2, 0.5)
    sock.settimeout(None)
    started = time.monotonic()
    seconds = max(deadline - started, min(timeout, _LATE_HANDSHAKE_SECONDS))
    try:
        duplicate = duplicate_connection(sock)
    except OSError:
        sock.close()
        raise
    handshakes = PendingHandshakes(1, seconds, name=f"client-{address}")
    try:
        connection = guarded_handshake(sock, duplicate, handshakes.admit(sock), authkey, handshakes, server=False)
    except _MpAuthenticationError as e:
        raise AuthenticationError(
            f"the server at {address!r} refused this client's key (or proved none): use the "
            f"cluster's key ({env.UNISON_AUTHKEY} / {env.UNISON_AUTHKEY_FILE})"
        ) from e
    except HandshakeCut as e:
        raise ClusterError(
            f"the server at {address!r} accepted the connection but did not answer the key handshake "
            f"within {seconds:.3g} s: it is overloaded (e.g. flooded with connections, or out of file "
            f"descriptors) or it is no unison server; retry, or connect with a longer timeout (was {timeout:g} s)"
        ) from e
    except (EOFError, ConnectionError) as e:
        raise ClusterError(
            f"the server at {address!r} closed the connection {time.monotonic() - started:.3g} s into the "
            f"key handshake, before judging this client's key: it is overloaded and dropping connections, "
            f"its handshake deadline (`unison server --handshake-timeout`) ran out, or it is no unison "
            f"server; retry"
        ) from e
    except OSError as e:
        raise ClusterError(f"the key handshake with the server at {address!r} failed ({e}); retry") from e
    finally:
        handshakes.close()
    return Channel(connection, address)
