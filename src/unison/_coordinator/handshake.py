"""The key handshake of one control-channel connection, bounded by one deadline.

Both ends of a connection prove that they hold the cluster's key with the HMAC
challenge of ``multiprocessing.connection`` before a single pickle is read. Kept apart
from the channel, the listener and ``connect`` that run it, because its deadline rests
on two parts that must stay together: a kernel-level socket timeout, so that no single
read outlives the handshake, and a ``PendingHandshakes`` registration, which bounds the
handshake as a whole however slowly a peer drips bytes.
"""

from __future__ import annotations

import os
import socket
import struct
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

from unison._coordinator.admission import PendingHandshakes

__all__ = ["HandshakeCut", "duplicate_connection", "guarded_handshake"]


def _set_io_timeout(sock: socket.socket, seconds: float) -> None:
    # A kernel-level timeout, so the blocking reads inside the stdlib handshake give up.
    tv = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def _handshake(sock: socket.socket, connection: Connection, authkey: bytes, *, server: bool, seconds: float) -> None:
    """Runs the mutual HMAC handshake over ``connection``; closes it and raises if that fails.

    ``connection`` holds its own descriptor of ``sock``'s socket (``duplicate_connection``).
    The caller registers ``sock`` with a ``PendingHandshakes`` (which bounds the whole
    handshake, not only each read) and closes ``sock`` afterwards.
    """
    _set_io_timeout(sock, seconds)  # no single read outlives the whole handshake's deadline
    try:
        if server:
            deliver_challenge(connection, authkey)
            answer_challenge(connection, authkey)
        else:
            answer_challenge(connection, authkey)
            deliver_challenge(connection, authkey)
        # Socket options belong to the shared open socket: clear the deadline for normal use.
        _set_io_timeout(sock, 0)
    except BaseException:
        connection.close()
        raise


def duplicate_connection(sock: socket.socket) -> Connection:
    """A Connection on its own descriptor of ``sock``'s socket (the reaper keeps ``sock``).

    The accept loop makes it itself, so that only that loop opens a handshake's
    descriptors and its count of the free ones holds until the next accept.
    """
    return Connection(os.dup(sock.fileno()))


class HandshakeCut(EOFError):
    """The handshake was cut: its deadline passed, or newer ones took its place."""


def guarded_handshake(
    sock: socket.socket,
    connection: Connection,
    token: int,
    authkey: bytes,
    handshakes: PendingHandshakes,
    *,
    server: bool,
) -> Connection:
    """``_handshake`` of ``sock``, admitted to ``handshakes`` as ``token``; closes ``sock`` either way,
    and ``connection`` (``duplicate_connection(sock)``) unless it returns it.

    Raises:
        HandshakeCut: if the handshake was cut (deadline, or evicted by newer ones), even
            when it finished just as it was cut, or a read outlived the deadline.
    """
    cut = HandshakeCut(f"the handshake did not finish within {handshakes.seconds:g} s")
    try:
        _handshake(sock, connection, authkey, server=server, seconds=handshakes.seconds)
    except BaseException as e:
        finished = handshakes.release(token, sock)
        if isinstance(e, (BlockingIOError, TimeoutError)):  # SO_RCVTIMEO: the deadline, seen first by a read
            raise cut from e
        if not finished and isinstance(e, (EOFError, OSError)):  # woken by the cut
            raise cut from e
        raise
    if not handshakes.release(token, sock):
        connection.close()
        raise cut
    return connection
