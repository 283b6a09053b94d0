"""A link to a ps task served in the requester's own process: each request applied where it is sent.

A worker that serves ps tasks itself (``unison launch --ps-in-workers``,
:mod:`unison._ps.task_server`) reaches them through this link instead of a socket: no
pickled header, no copy through the kernel, no thread woken. ``send`` applies the request
at once, in the caller's thread, through the same :class:`~unison._ps.task.sessions.SessionCore`
a socket session uses (so a failed row push answers the next request, as over a socket);
``recv`` hands back its answer. ``PSClient`` sends to in-process links after the others (so
the ps tasks of other processes work on their requests meanwhile), and a request with a
reply only once the others have replied: meanwhile this process serves the other workers'
requests to its shards, which would otherwise queue on a shard's lock behind this thread's.
A synchronous job's training lookup (``TableRows.lookers`` > 1) is posted to its shard at
``send`` and taken at ``recv`` (``TableShards.post_rows``): meanwhile the session threads of
this process look it up with the other workers' lookups of the step.

The request's tensors are the caller's own: every handler reads them and keeps copies only
(over a socket they are buffers reused by the next request). Dense pulls get tensors of
their own (``new_session(reuse_pull_buffers=False)``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from unison._ps.task.parameter_store import ParameterStore
from unison._ps.task.sessions import SessionCore, new_session

__all__ = ["InProcessLink"]


class InProcessLink:
    """The :class:`~unison._ps.wire.links.TensorLink` interface, served in this process.

    Callers hold ``lock`` around a request and its reply, as with a TensorLink.
    """

    in_process = True
    """``PSClient`` sends to these after the links to other processes."""

    def __init__(self, store: ParameterStore, peer: str):
        self.peer = peer
        self.lock = threading.Lock()
        self._session = new_session(store, reuse_pull_buffers=False)
        self._core = SessionCore(self._session)
        self._answer: tuple[Any, list[torch.Tensor]] | None = None
        self._later: Callable[[], tuple[Any, list[torch.Tensor]]] | None = None  # a posted lookup's answer
        self._closed = False

    def send(self, header: Any, tensors: Sequence[torch.Tensor] = ()) -> None:
        """Applies the request now; its answer waits for :meth:`recv` (a row push that succeeds has none).

        Raises:
            EOFError: if the link was closed (its server stopped).
        """
        if self._closed:
            raise EOFError(f"{self.peer} is no longer served in this process")
        tensors = [t.detach() for t in tensors]
        self._later = self._core.post(header, tensors)  # a gathered lookup: taken in recv
        if self._later is not None:
            return
        answer = self._core.answer(header, tensors)
        if answer is not None:
            self._answer = answer

    def recv(self, into: Sequence[torch.Tensor | None] | None = None, timeout: float | None = None,
             reuse: bool = False) -> tuple[Any, list[torch.Tensor]]:
        """The answer to the last request sent; tensors copied into ``into`` where given.

        Raises:
            EOFError: if no request is waiting for its answer (the link was closed).
        """
        if self._later is not None:
            self._answer, self._later = self._later(), None
        if self._answer is None:
            raise EOFError(f"{self.peer}: no answer is waiting on this in-process link")
        header, tensors = self._answer
        self._answer = None
        if into is None:
            return header, list(tensors)
        targets = list(into) + [None] * (len(tensors) - len(into))
        return header, [t if target is None else target.copy_(t) for target, t in zip(targets, tensors)]

    def request(self, header: Any, tensors: Sequence[torch.Tensor] = (),
                into: Any = None) -> tuple[Any, list[torch.Tensor]]:
        """Sends a request and returns its answer, holding ``lock``."""
        with self.lock:
            self.send(header, tensors)
            return self.recv(into)

    def close(self) -> None:
        """Ends the link: later requests raise EOFError (as a closed socket's)."""
        self._closed = True
        self._answer = self._later = None
        self._session.shared.close()
