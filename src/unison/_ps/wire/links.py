"""Tensor messages over the cluster's authenticated control channel.

Parameter-server traffic is a few large tensors per request (a worker's packed pull or
push). They travel as raw bytes after a small pickled header, and are received
straight into their destination (a worker's parameter, a freshly allocated tensor), so
a pull costs one copy from the socket and no pickling of tensor data.

Why not ``torch.distributed.rpc``: an RPC group is formed once by all tasks, a worker
that dies can break TensorPipe for every peer, and a worker cannot rejoin under its
name. Here each worker opens its own authenticated connection to each ps task (the
``multiprocessing.connection`` HMAC handshake of :mod:`unison._coordinator.channel`),
so a worker dying closes only its own connections and a restarted worker just
connects again.
"""

from __future__ import annotations

import os
import pickle
import socket
import threading
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

import torch

from unison._coordinator.channel import Channel, connect
from unison._ps.wire.protocol import PROTOCOL_VERSION, Accepted, Hello, Refused, decode, dumps_header
from unison.errors import ParameterServerError

__all__ = ["SAME_HOST_SEND_BUFFER", "TensorLink", "open_link", "serving_link", "set_nodelay", "widen_send_buffer"]

# The byte that carries a same-host link's reply socket to the ps task.
_REPLIES_MARK = b"R"


def _socket_on(connection: Connection) -> socket.socket:
    """A socket object on a duplicate of ``connection``'s descriptor (the caller closes it)."""
    return socket.socket(fileno=os.dup(connection.fileno()))


def set_nodelay(channel: Channel) -> None:
    """Turns off Nagle's algorithm on ``channel``: a request is several writes, and
    waiting for the peer's delayed ACK between them would add ~40 ms to each."""
    with _socket_on(channel.connection) as sock:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass  # not TCP


#: What a same-host (Unix socket) link asks for its send buffer: TCP's own ceiling (``tcp_wmem``'s
#: default maximum, which loopback TCP grows to). The kernel caps it at ``net.core.wmem_max``.
SAME_HOST_SEND_BUFFER = 4 << 20


def widen_send_buffer(sock: socket.socket) -> None:
    """Asks for a send buffer of ``SAME_HOST_SEND_BUFFER`` on a Unix socket (TCP sockets grow theirs).

    A Unix socket's default (``net.core.wmem_default``, 208 KB) is smaller than a ps task's reply
    to a 256 KB row pull: the ps task's thread waited mid-write until its worker came to read that
    reply, which a worker with requests out to two ps tasks does only after reading the other's.
    The ParameterServerStrategy embedding job with two ps tasks ran 0.88x its speed over TCP so,
    0.96-0.97x with this (``benchmarks/RESULTS.md``, issue 45). Even a stock ``wmem_max`` (208 KB,
    which the kernel doubles) leaves room for such a reply."""
    if sock.family == socket.AF_UNIX:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SAME_HOST_SEND_BUFFER)


def _ends(replacement: socket.socket) -> tuple[Connection, socket.socket]:
    """A Connection for headers and a socket object for tensor frames on ``replacement`` (taken over)."""
    connection = Connection(replacement.detach())
    return connection, _socket_on(connection)


def _is_same_host(channel: Channel) -> bool:
    with _socket_on(channel.connection) as sock:
        return sock.family == socket.AF_UNIX


def _hand_over_replies(channel: Channel) -> socket.socket:
    """A worker's end of a same-host link: a new socket pair for the ps task's replies, one end
    sent to the ps task over the channel (``SCM_RIGHTS``), the other returned.

    Why a socket of their own: a Unix socket wakes every thread asleep on it whenever the bytes
    it sent are read (TCP only a writer that ran out of room). On one socket both ways, a ps
    task asleep for the next request was woken as its worker read each part of its reply
    (``benchmarks/RESULTS.md``, issue 45)."""
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with _socket_on(channel.connection) as sock:
            socket.send_fds(sock, [_REPLIES_MARK], [theirs.fileno()])
    except BaseException:
        mine.close()
        raise
    finally:
        theirs.close()
    return mine


def _take_replies(channel: Channel) -> socket.socket:
    """A ps task's end of a same-host link: the socket its worker handed over for the replies.

    Raises:
        EOFError: if the peer closed the connection, or sent something else.
    """
    with _socket_on(channel.connection) as sock:
        mark, fds, _flags, _address = socket.recv_fds(sock, len(_REPLIES_MARK), 1)
    if mark != _REPLIES_MARK or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise EOFError(f"{channel.peer} closed the session or did not hand over its reply socket")
    os.set_inheritable(fds[0], False)
    return socket.socket(fileno=fds[0])


def serving_link(channel: Channel, replies_apart: bool = False) -> TensorLink:
    """The ps task's end of an accepted session (after ``Accepted``); on a same-host link whose
    peer asked for ``replies_apart`` (its ``Hello``), the replies go out on the socket the peer
    handed over (:func:`open_link`).

    Raises:
        EOFError / OSError: if the peer went away before handing it over.
    """
    outbound = _take_replies(channel) if replies_apart and _is_same_host(channel) else None
    return TensorLink(channel, channel.peer, outbound=outbound)


def _bytes_view(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().reshape(-1)
    return flat.view(torch.uint8).numpy().data if flat.numel() else memoryview(b"")


class TensorLink:
    """Sends and receives ``(header, [tensors])`` messages on an authenticated Channel.

    The header is any picklable object; each tensor goes as its own raw frame. Not
    thread-safe for interleaved requests: callers hold ``lock`` around a request and
    its reply.
    """

    in_process = False
    """A socket to another process (``InProcessLink`` is the one link for which this is True)."""

    def __init__(self, channel: Channel, peer: str, *, inbound: socket.socket | None = None,
                 outbound: socket.socket | None = None):
        """``inbound`` / ``outbound``: a socket that messages come in on / go out on instead of the
        channel's (a same-host link's replies: :func:`open_link`, :func:`serving_link`)."""
        self.channel = channel
        self.peer = peer
        self.lock = threading.Lock()
        set_nodelay(channel)
        # The Channel's Connection carries raw frames; Channel itself only sends pickles. Tensor
        # frames go through a socket object on the same descriptor: sendall from the tensor's
        # memory and recv_into the destination (Connection.recv_bytes_into would first read the
        # whole frame into a BytesIO, then copy it).
        own = (channel.connection, _socket_on(channel.connection))
        self._in_connection, self._in_socket = _ends(inbound) if inbound is not None else own
        self._out_connection, self._out_socket = _ends(outbound) if outbound is not None else own
        widen_send_buffer(self._out_socket)
        self._scratch: dict[int, torch.Tensor] = {}

    def send(self, header: Any, tensors: Sequence[torch.Tensor] = ()) -> None:
        """Sends ``header`` and ``tensors`` (made contiguous, CPU).

        (Sending header and tensor frames in one gathered ``sendmsg`` instead was measured: the
        hybrid DLRM's samples/s did not move, ``benchmarks/RESULTS.md``; not kept.)"""
        tensors = [t.detach().contiguous().cpu() for t in tensors]
        meta = [(tuple(t.shape), t.dtype) for t in tensors]
        self._out_connection.send_bytes(dumps_header(header, meta))
        for t in tensors:
            if t.numel():
                self._out_socket.sendall(_bytes_view(t))

    def recv(self, into: Sequence[torch.Tensor] | None = None, timeout: float | None = None,
             reuse: bool = False) -> tuple[Any, list[torch.Tensor]]:
        """The next message; tensors are written into ``into`` where given (same shapes), else allocated.

        With ``reuse``, tensors are received into buffers this link keeps from earlier
        messages of the same layout (no allocation and first-touch page faults per
        message): the caller must be done with them before the next ``recv``.

        Raises:
            EOFError / OSError: when the peer is gone.
            TimeoutError: if no message starts within ``timeout`` seconds.
        """
        if timeout is not None and not self._in_connection.poll(timeout):
            raise TimeoutError(f"{self.peer} did not answer within {timeout:g} s")
        header, meta = pickle.loads(self._in_connection.recv_bytes())
        header = decode(header)
        tensors = []
        for i, (shape, dtype) in enumerate(meta):
            target = into[i] if into is not None and i < len(into) and into[i] is not None else None
            if target is None and reuse:
                target = self._scratch.get(i)
            if target is None or tuple(target.shape) != shape or target.dtype != dtype or not target.is_contiguous():
                target = torch.empty(shape, dtype=dtype)
                if reuse:
                    self._scratch[i] = target  # replaces the last layout's: requests of varying sizes keep one each
            if target.numel():
                self._recv_into(_bytes_view(target))
            tensors.append(target)
        return header, tensors

    def _recv_into(self, view: memoryview) -> None:
        position, size = 0, len(view)
        while position < size:
            received = self._in_socket.recv_into(view[position:])
            if not received:
                raise EOFError(f"{self.peer} closed the connection")
            position += received

    def request(
        self, header: Any, tensors: Sequence[torch.Tensor] = (), into: Any = None
    ) -> tuple[Any, list[torch.Tensor]]:
        """Sends a request and returns its reply, holding ``lock``."""
        with self.lock:
            self.send(header, tensors)
            return self.recv(into)

    def close(self) -> None:
        """Closes the connection (and a same-host link's reply socket)."""
        for sock in (self._in_socket, self._out_socket):
            sock.close()
        for connection in (self._in_connection, self._out_connection):
            if connection is not self.channel.connection:
                connection.close()
        self.channel.close()


def open_link(address: str, authkey: bytes, session: str, peer: str, timeout: float = 60.0,
              replies_apart: bool = False) -> TensorLink:
    """Connects to the standard server at ``address`` and opens a ``session`` ("ps") on it.

    The session opens with the protocol's :class:`~unison._ps.wire.protocol.Hello`; the peer
    accepts it or refuses another version. ``replies_apart``: where the peer is on this host,
    its replies come on a socket of their own (:func:`_hand_over_replies`): a
    ParameterServerStrategy worker's links; not the hybrid DLRM's, which ran 0.84-0.90x so
    (``benchmarks/RESULTS.md``, issue 45).

    Raises:
        ParameterServerError: if the peer refuses (another unison version), or does not answer
            the handshake within ``timeout``.
    """
    channel = connect(address, authkey, timeout, same_host_first=True)  # a ps on this host: no TCP/IP
    channel.send((session, Hello(PROTOCOL_VERSION, replies_apart)))
    if not channel.connection.poll(timeout):
        channel.close()
        raise ParameterServerError(f"{peer} at {address} did not answer the ps handshake within {timeout:g} s")
    answer = channel.recv()
    if not isinstance(answer, Accepted):
        channel.close()
        reason = answer.reason if isinstance(answer, Refused) else f"an unexpected answer {answer!r:.80}"
        raise ParameterServerError(f"{peer} at {address} refused the ps session: {reason}")
    try:
        inbound = _hand_over_replies(channel) if replies_apart and _is_same_host(channel) else None
    except OSError as e:
        channel.close()
        raise ParameterServerError(f"{peer} at {address} went away as the session opened ({e})") from e
    return TensorLink(channel, peer, inbound=inbound)
