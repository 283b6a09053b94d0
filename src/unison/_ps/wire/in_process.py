"""ps tasks served inside this process, found by their cluster address.

With ``unison launch --ps-in-workers`` a worker serves ps tasks in its own process
(:mod:`unison._ps.task_server`). Its own requests to them need no socket: the server
registers here, under its cluster address, a function that opens an in-process link
(:class:`~unison._ps.task.in_process_link.InProcessLink`), and ``PSClient`` asks here
before it connects. The registry sits on the wire side so that the requester's code
does not import the ps task's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = ["register", "unregister", "opener_for"]

#: Opens a link to the ps task: ``opener(peer name)``.
Opener = Callable[[str], Any]

_OPENERS: dict[str, Opener] = {}
_LOCK = threading.Lock()


def register(address: str, opener: Opener) -> None:
    """Serves requests to ``address`` in this process from now on, through links ``opener`` makes."""
    with _LOCK:
        _OPENERS[address] = opener


def unregister(address: str, opener: Opener) -> None:
    """Stops serving ``address`` in this process (if ``opener`` is still the one registered)."""
    with _LOCK:
        if _OPENERS.get(address) == opener:  # ==: a bound method is a new object at each access
            del _OPENERS[address]


def opener_for(address: str) -> Opener | None:
    """The in-process link maker of the ps task at ``address``, or None when no server of this process serves it."""
    with _LOCK:
        return _OPENERS.get(address)
