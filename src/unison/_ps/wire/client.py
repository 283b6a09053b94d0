"""The requester's side of the ps tasks: packed pulls and pushes, one request per ps task.

Workers and the coordinator each hold one :class:`PSClient`, with one connection per
ps task opened on first use. A call that touches several ps tasks sends every request
first and then collects the replies, so the ps tasks work in parallel.

A worker's client has a :class:`~unison._ps.wire.shared_arena.SharedArena`: its cached
parameters live there, and with a ps task on the same host (found out by the first
request that could use it) dense pulls and pushes name places in it instead of
carrying the bytes over the socket. A ps task served in this very process
(``unison launch --ps-in-workers``) is reached without a socket at all
(:mod:`unison._ps.wire.in_process`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from unison._cluster import env
from unison._ps.wire import in_process
from unison._ps.wire import protocol as wire
from unison._ps.wire.links import TensorLink, open_link
from unison._ps.wire.shared_arena import Place, SharedArena
from unison.errors import AuthenticationError, ParameterServerError

__all__ = ["PSClient", "Request"]

#: ps task index -> (header, tensors to send, tensors to receive into or None)
Request = "dict[int, tuple[Any, Sequence[torch.Tensor], Any]]"


class PSClient:
    """Connections to every ps task of a cluster.

    Args:
        addresses: the ps tasks' addresses, by index.
        authkey: the cluster's key.
        timeout: seconds to wait for a ps task to accept a connection, and (when
            ``reply_timeout`` is set) for a reply.
        shared: keep an arena of shared memory for same-host ps tasks (a worker's client).
        replies_apart: a same-host ps task's replies come on a socket of their own
            (``unison._ps.wire.links.open_link``): a ParameterServerStrategy worker's client.
    """

    def __init__(self, addresses: Sequence[str], authkey: bytes, timeout: float = 30.0,
                 reply_timeout: float | None = None, shared: bool = False, replies_apart: bool = False):
        self.addresses = list(addresses)
        self._authkey = authkey
        self._timeout = timeout
        self._reply_timeout = reply_timeout
        self._replies_apart = replies_apart
        self._links: dict[int, TensorLink] = {}  # or an InProcessLink (the same interface)
        self._lock = threading.Lock()
        self.arena: SharedArena | None = SharedArena() if shared and SharedArena.available() else None
        #: per ps task: the arena segments it has mapped, or None once it could not (another host)
        self._attached: dict[int, set[str] | None] = {}
        self._grad_slots: dict[tuple[int, str], torch.Tensor] = {}
        #: ps tasks sent a request without waiting (a row push) that no reply has confirmed since
        self._unconfirmed: set[int] = set()
        #: ps tasks this client has opened a session with (a failure to reach one later means it is lost)
        self._reached: set[int] = set()

    def new_tensor(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor for a worker's cached parameter: in the arena when there is one."""
        if self.arena is None:
            return torch.empty(shape, dtype=dtype)
        return self.arena.tensor(shape, dtype)

    def _shares(self, index: int) -> bool:
        """Whether ps task ``index`` has mapped every arena segment (asking it to, first)."""
        if self.arena is None or in_process.opener_for(self.addresses[index]) is not None:
            return False  # an in-process ps task copies straight from and into the tensors named
        attached = self._attached.get(index, set())
        if attached is None:
            return False
        infos = [info for info in self.arena.segments() if info[0] not in attached]
        if infos:
            ok = bool(self.exchange({index: (wire.Attach(tuple(infos)), (), None)})[index][0])
            if not ok:
                self._attached[index] = None
                return False
            attached = attached | {info[0] for info in infos}
            self._attached[index] = attached
        return True

    def _grad_place(self, index: int, key: str, grad: torch.Tensor) -> Place | None:
        """Copies a dense gradient for ``key`` on ps ``index`` into its slot in the arena; the slot's place."""
        assert self.arena is not None
        slot = self._grad_slots.get((index, key))
        if slot is None or slot.shape != grad.shape or slot.dtype != grad.dtype:
            slot = self._grad_slots[(index, key)] = self.arena.tensor(grad.shape, grad.dtype)
        slot.copy_(grad)
        return self.arena.place(slot)

    def _lost(self, index: int, cause: BaseException) -> ParameterServerError:
        return ParameterServerError(
            f"ps:{index} at {self.addresses[index]} is unavailable ({type(cause).__name__}: {cause}); "
            f"its variables are lost: restart the cluster and restore the last checkpoint"
        )

    def _refused(self, index: int) -> ParameterServerError:
        # Not _lost: the ps task turned away this client only, and serves on with its
        # variables; restarting the cluster would not help while the keys differ.
        return ParameterServerError(
            f"ps:{index} at {self.addresses[index]} refused this task's key: the tasks of this cluster do not "
            f"hold the same key; give every task the same {env.UNISON_AUTHKEY} (or {env.UNISON_AUTHKEY_FILE}) "
            f"and start this task again"
        )

    def _unreachable(self, index: int, cause: BaseException) -> ParameterServerError:
        # Not _lost: this client never reached the ps task, so it lost nothing of its; the
        # task may still be starting, or the cluster spec may name the wrong address.
        return ParameterServerError(
            f"ps:{index} at {self.addresses[index]} could not be reached ({type(cause).__name__}: {cause}); this "
            f"task had not reached it before, so no variables were lost: start the ps task or fix its address in "
            f"the cluster spec, then start this task again"
        )

    def _link(self, index: int) -> TensorLink:
        with self._lock:
            link = self._links.get(index)
            if link is None:
                opener = in_process.opener_for(self.addresses[index])
                if opener is not None:  # served by this process: no socket
                    link = self._links[index] = opener(f"ps:{index}")
                    self._reached.add(index)
                    return link
                try:
                    link = open_link(self.addresses[index], self._authkey, "ps", f"ps:{index}", self._timeout,
                                     self._replies_apart)
                except AuthenticationError as e:
                    raise self._refused(index) from e
                except ParameterServerError:
                    raise  # the ps task answered and refused the session (another version): open_link says why
                except Exception as e:
                    raise (self._lost(index, e) if index in self._reached else self._unreachable(index, e)) from e
                self._links[index] = link
                self._reached.add(index)
            return link

    def exchange(self, requests: dict[int, tuple[Any, Sequence[torch.Tensor], Any]], *,
                 wait: bool = True, gathered: bool = False) -> dict[int, list[torch.Tensor]]:
        """Sends each ps task its request, then returns each reply's tensors.

        With ``wait=False`` (row pushes only: ``wire.ANSWERED_ON_FAILURE``) it returns once the
        requests are sent: a ps task answers such a request only if it fails, and then at this
        client's next request to it that has a reply, which raises the push's error.
        :meth:`settle` waits until they are applied.

        ``gathered``: each ps task looks up every worker's request of the step together (a
        synchronous job's training lookups, ``TableShards.rows``), so a request to a ps task in
        this process is posted there before the others' replies are read (the other workers'
        requests to it wait for it) and taken after them (``TableShards.post_rows``).

        Raises:
            ParameterServerError: naming ``ps:K`` if it is gone or does not answer.
            Exception: what the ps task raised for a bad request (with its traceback as a note).
            ValueError: a request with a reply sent with ``wait=False``.
        """
        if not wait:
            unanswerable = [h for h, _, _ in requests.values() if h.KIND not in wire.ANSWERED_ON_FAILURE]
            if unanswerable:
                raise ValueError(f"PSClient.exchange(wait=False) sends only requests that have no reply "
                                 f"(wire.ANSWERED_ON_FAILURE), got {unanswerable[0]!r:.200}")
        order = sorted(requests)
        links = {i: self._link(i) for i in order}
        for i in order:  # one lock order for every caller: no deadlock between threads
            links[i].lock.acquire()
        try:
            # An in-process link applies a request as it is sent, in this thread. Sent after the
            # others: their ps tasks work meanwhile. Applied after their replies when it has one
            # (a lookup): while this thread waits, its process serves the other workers' requests
            # to the same shard without queueing on the shard's lock behind this thread's own
            # (the hybrid DLRM ran 1.03-1.15x faster so, 6 pairs: benchmarks/RESULTS.md). A gathered
            # lookup is posted as it is sent, and taken after the others' replies, the same way.
            in_proc = [i for i in order if links[i].in_process]
            others = [i for i in order if i not in in_proc]
            phases = [others, in_proc] if wait and not gathered else [others + in_proc]
            replies: dict[int, list[torch.Tensor]] = {}
            error: BaseException | None = None
            for phase in phases:
                for i in phase:
                    header, tensors, _ = requests[i]
                    try:
                        links[i].send(header, tensors)
                    except (EOFError, OSError) as e:
                        self._drop(i)
                        raise self._lost(i, e) from e
                if not wait:
                    self._unconfirmed.update(order)
                    return {}
                for i in phase:
                    try:
                        header, tensors = links[i].recv(requests[i][2], self._reply_timeout)
                    except (EOFError, OSError, TimeoutError) as e:
                        self._drop(i)
                        raise self._lost(i, e) from e
                    self._unconfirmed.discard(i)  # the ps task applied everything sent before
                    if isinstance(header, wire.Failed) and error is None:
                        error = header.error
                        if header.earlier:
                            error.add_note(f"raised on ps:{i} by an earlier request sent without waiting (a row "
                                           f"push); the request answered by it was not applied")
                        if header.traceback:
                            error.add_note(f"traceback on ps:{i}:\n{header.traceback}")
                    replies[i] = tensors
            if error is not None:
                raise error
            return replies
        finally:
            for i in order:
                links[i].lock.release()

    def settle(self) -> None:
        """Waits until every request sent without waiting has been applied (raises its error, if any)."""
        # a copy first (another thread may push meanwhile); a dropped link's entry went with it (_drop)
        pending = sorted(i for i in tuple(self._unconfirmed) if i in self._links)
        if pending:
            self.exchange({i: (wire.Ping(), (), None) for i in pending})

    def _drop(self, index: int) -> None:
        with self._lock:
            link = self._links.pop(index, None)
            self._attached.pop(index, None)
            self._unconfirmed.discard(index)
        if link is not None:
            link.close()

    # -- requests ---------------------------------------------------------------------
    def read(self, placed: Sequence[tuple[int, str]]) -> list[torch.Tensor]:
        """The values of ``(ps index, key)`` pairs, in order."""
        by_ps: dict[int, list[int]] = {}
        for position, (index, _) in enumerate(placed):
            by_ps.setdefault(index, []).append(position)
        replies = self.exchange({i: (wire.Pull(tuple(placed[p][1] for p in ps)), (), None) for i, ps in by_ps.items()})
        out: list[Any] = [None] * len(placed)
        for i, positions in by_ps.items():
            for p, t in zip(positions, replies[i]):
                out[p] = t
        return out

    def pull_into(self, by_ps: dict[int, list[tuple[str, torch.Tensor]]]) -> None:
        """Reads each key straight into its destination tensor (a worker's parameter).

        A ps task on this host copies into destinations in the arena itself."""
        requests: dict[int, tuple[Any, Sequence[torch.Tensor], Any]] = {}
        for i, items in by_ps.items():
            places = [self.arena.place(d) for _, d in items] if self.arena is not None else []
            if places and all(p is not None for p in places) and self._shares(i):
                requests[i] = (wire.PullShared(tuple(k for k, _ in items), tuple(places)), (), None)
            else:
                requests[i] = (wire.Pull(tuple(k for k, _ in items)), (), [d for _, d in items])
        self.exchange(requests)

    def write(self, kind: type[wire.Create | wire.Assign | wire.Add], placed: Sequence[tuple[int, str]],
              values: Sequence[torch.Tensor]) -> None:
        """``wire.Create``, ``wire.Assign`` or ``wire.Add`` values at ``(ps index, key)`` pairs,
        one request per ps task."""
        by_ps: dict[int, tuple[list[str], list[torch.Tensor]]] = {}
        for (index, key), value in zip(placed, values):
            keys, tensors = by_ps.setdefault(index, ([], []))
            keys.append(key)
            tensors.append(value)
        self.exchange({i: (kind(tuple(keys)), tensors, None) for i, (keys, tensors) in by_ps.items()})

    def pull_rows(self, by_ps: dict[int, list[tuple[str, torch.Tensor]]]) -> dict[int, list[torch.Tensor]]:
        """Rows (local ids) of shards, per ps task."""
        return self.exchange({i: (wire.PullRows(tuple(k for k, _ in items)), [ids for _, ids in items], None)
                              for i, items in by_ps.items()})

    def push(self, by_ps: dict[int, list[tuple[str, torch.Tensor | None, torch.Tensor, type, dict]]]) -> None:
        """Applies gradients: ``(key, row ids or None, grad, optimizer class, hyper-parameters)`` per ps task."""
        requests: dict[int, tuple[Any, Sequence[torch.Tensor], Any]] = {}
        for i, items in by_ps.items():
            may_share = self.arena is not None and self._attached.get(i, set()) is not None
            # slots first: a slot in a new segment is attached by _shares below
            places: list[Any] = [self._grad_place(i, key, grad)
                                 if may_share and ids is None and grad.layout == torch.strided
                                 else None for key, ids, grad, _, _ in items]
            if not (may_share and self._shares(i)):
                places = [None] * len(items)
            tensors: list[torch.Tensor] = []
            for (_, ids, grad, _, _), place in zip(items, places):
                if ids is not None:
                    tensors.append(ids)
                if place is None:
                    tensors.append(grad)
            header = wire.Push(tuple(wire.PushEntry(k, ids is not None, c, h, place)
                                     for (k, ids, _, c, h), place in zip(items, places, strict=True)))
            requests[i] = (header, list(tensors), None)
        self.exchange(requests)

    def optimizer_states(self, placed: Sequence[tuple[int, str]]) -> list[dict[type, dict[str, Any]]]:
        """Per ``(ps index, key)``: the state each optimizer class keeps for it on its ps task."""
        by_ps: dict[int, list[int]] = {}
        for position, (index, _) in enumerate(placed):
            by_ps.setdefault(index, []).append(position)
        replies = self.exchange({i: (wire.OptimizerStates(tuple(placed[p][1] for p in ps)), (), None)
                                 for i, ps in by_ps.items()})
        out: list[Any] = [None] * len(placed)
        for i, positions in by_ps.items():
            for p, state in zip(positions, wire.unpickled(replies[i][0])):
                out[p] = state
        return out

    def load_optimizer_states(self, entries: Sequence[tuple[int, str, type, dict, dict[str, Any]]]) -> None:
        """Sets optimizer states: ``(ps index, key, optimizer class, hyper-parameters, state)``."""
        by_ps: dict[int, list[tuple[str, type, dict, dict[str, Any]]]] = {}
        for index, key, cls, hyper, state in entries:
            by_ps.setdefault(index, []).append((key, cls, hyper, state))
        self.exchange({i: (wire.LoadOptimizerStates(tuple(k for k, _, _, _ in items),
                                                    tuple((c, h) for _, c, h, _ in items)),
                           [wire.pickled([s for _, _, _, s in items])], None) for i, items in by_ps.items()})

    def ping(self, index: int) -> None:
        """Raises ParameterServerError unless ps task ``index`` answers."""
        self.exchange({index: (wire.Ping(), (), None)})

    def close(self) -> None:
        """Closes every connection."""
        with self._lock:
            links, self._links = list(self._links.values()), {}
            self._attached.clear()
        for link in links:
            link.close()
        self._grad_slots.clear()
        if self.arena is not None:
            self.arena.close()
