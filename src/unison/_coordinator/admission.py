"""Admission of unauthenticated connections: a bounded number, each with one deadline.

Until a peer has proved that it holds the cluster's key it costs the server two file
descriptors and a thread, and it can say nothing, or one byte every few seconds. A
per-read socket timeout does not bound that (every byte restarts it), and an unbounded
number of such peers exhausts the process's descriptors, after which ``accept`` fails.
So every handshake under way is registered here: one reaper thread shuts a socket down
when its handshake has run for ``seconds`` in all, and when ``limit`` handshakes are
already under way the oldest is shut down to make room. A real client finishes its
handshake in milliseconds, so dropping the oldest keeps serving key holders while
silent peers are held open against the server; refusing the newest instead would turn
away exactly them.

A fixed ``limit`` is not enough where the process may open fewer descriptors than
``limit`` handshakes take: ``accept`` fails first, nobody is dropped, and every
descriptor stays held for the whole deadline. So the listener also asks
``handshake_budget`` before each ``accept`` how many handshakes the descriptors actually
free (``RLIMIT_NOFILE`` less what the process holds, counted in ``/proc/self/fd`` by
``descriptor_usage``) can carry, and ``shed_to`` drops the oldest down to it.

tf.distribute equivalent: none (gRPC servers bound their pending streams themselves).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator

try:
    import resource
except ImportError:  # not on Windows: descriptors are not counted there
    resource = None  # type: ignore[assignment]

__all__ = ["DESCRIPTORS_PER_HANDSHAKE", "PendingHandshakes", "descriptor_usage", "handshake_budget"]

#: File descriptors one handshake under way holds: the accepted socket and the
#: ``Connection``'s duplicate of it.
DESCRIPTORS_PER_HANDSHAKE = 2


def _open_descriptors() -> int | None:
    """How many file descriptors this process holds, or None where that cannot be counted."""
    for directory in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(directory)) - 1  # less listdir's own descriptor of the directory
        except OSError:
            continue
    return None


def descriptor_usage() -> tuple[int, int] | None:
    """``(open, limit)``: the file descriptors this process holds and its ``RLIMIT_NOFILE``.

    None where there is no limit or the open ones cannot be counted (no ``/proc``):
    there only a failing ``accept`` tells that descriptors ran out.
    """
    if resource is None:
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return None
    held = _open_descriptors()
    return None if held is None else (held, soft)


def handshake_budget(free: int, held_by_handshakes: int) -> int:
    """Most handshakes that may be under way when ``free`` descriptors are left.

    Handshakes may hold half of the descriptors the rest of the process leaves them
    (those free plus those they hold already): the other half stays for the clients
    they let in and for the work those clients send. At least one, so a key holder can
    always get in by dropping the oldest peer.

    Args:
        free: descriptors the process may still open (limit less open, ``descriptor_usage()``).
        held_by_handshakes: descriptors held by the handshakes under way, including
            those already cut whose threads have not closed them yet.
    """
    return max(1, (free + held_by_handshakes) // 2 // DESCRIPTORS_PER_HANDSHAKE)


class PendingHandshakes:
    """The sockets whose handshake is under way: at most ``limit``, each cut at its deadline.

    "Cutting" a socket shuts it down in both directions, which wakes the thread blocked
    in the handshake's read with EOF; that thread still owns and closes the socket.

    Args:
        limit: most handshakes under way at once; admitting one more shuts the oldest down.
        seconds: the deadline of a whole handshake, from its admission.
        name: names the reaper thread.

    Attributes:
        timed_out: handshakes cut at their deadline so far.
        evicted: handshakes cut to make room for a newer one so far (``limit`` reached).
        shed: handshakes cut by ``shed_to`` so far (too few descriptors).
    """

    def __init__(self, limit: int, seconds: float, name: str = "handshakes"):
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit!r}")
        if not seconds > 0:
            raise ValueError(f"seconds must be positive, got {seconds!r}")
        self.limit, self.seconds = limit, seconds
        self.timed_out = self.evicted = self.shed = 0
        # Insertion order is deadline order: every deadline is admission time + `seconds`.
        self._pending: dict[int, tuple[float, socket.socket]] = {}
        # Cut, but their threads have not released them (nor closed their sockets) yet.
        self._cut_unreleased: set[int] = set()
        self._next_token = 0
        self._closed = False
        self._changed = threading.Condition()
        self._reaper = threading.Thread(target=self._reap, name=f"unison-reaper-{name}", daemon=True)
        self._reaper.start()

    def __len__(self) -> int:
        with self._changed:
            return len(self._pending)

    @property
    def closing(self) -> int:
        """Handshakes cut whose threads have not yet released them: their descriptors are
        about to be closed."""
        with self._changed:
            return len(self._cut_unreleased)

    def shed_to(self, count: int) -> int:
        """Cuts the oldest handshakes until at most ``count`` are under way; returns how many."""
        with self._changed:
            cut = 0
            while len(self._pending) > max(0, count):
                self._cut(next(iter(self._pending)))
                cut += 1
            self.shed += cut
            return cut

    def admit(self, sock: socket.socket) -> int:
        """Registers ``sock``'s handshake; returns the token to ``release`` it with."""
        with self._changed:
            while len(self._pending) >= self.limit:
                self._cut(next(iter(self._pending)))
                self.evicted += 1
            token = self._next_token
            self._next_token += 1
            self._pending[token] = (time.monotonic() + self.seconds, sock)
            if self._closed:
                self._cut(token)
            self._changed.notify()
        return token

    def release(self, token: int, sock: socket.socket) -> bool:
        """Unregisters a finished handshake and closes ``sock``; False if it was cut (its
        connection is dead).

        ``sock`` is closed only once the reaper can no longer touch it, and a cut one stops
        counting in ``closing`` only once it is closed (its descriptor is free).
        """
        with self._changed:
            finished = self._pending.pop(token, None) is not None
        sock.close()
        with self._changed:
            self._cut_unreleased.discard(token)
        return finished

    def close(self) -> None:
        """Cuts every handshake under way and stops the reaper."""
        with self._changed:
            self._closed = True
            for token in list(self._pending):
                self._cut(token)
            self._changed.notify()
        self._reaper.join(timeout=5)

    def _cut(self, token: int) -> None:
        _, sock = self._pending.pop(token)
        self._cut_unreleased.add(token)
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # the peer is already gone

    def _expired(self, now: float) -> Iterator[int]:
        for token, (deadline, _) in self._pending.items():
            if deadline > now:
                return
            yield token

    def _reap(self) -> None:
        with self._changed:
            while not self._closed:
                now = time.monotonic()
                for token in list(self._expired(now)):
                    self._cut(token)
                    self.timed_out += 1
                if self._pending:
                    first_deadline = next(iter(self._pending.values()))[0]
                    self._changed.wait(max(0.0, first_deadline - now) + 0.001)
                else:
                    self._changed.wait()
