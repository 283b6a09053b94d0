"""A ps task's sessions: the handshake, then each typed request dispatched to its handler.

One session per peer (a worker, the chief, a hybrid worker), in its own thread of the ps
task's server. The peer's :class:`~unison._ps.wire.protocol.Hello` is checked first: another
protocol version is refused and the session closed. Then every request is dispatched on its
header's class through :data:`_HANDLERS` (one entry per
:class:`~unison._ps.wire.protocol.RequestKind`, checked by the architecture tests), applied to
the ps task's parameter store or table shards, and answered with ``Ok`` and the reply's
tensors, or ``Failed`` with the exception, which the requester raises.
"""

from __future__ import annotations

import dataclasses
import traceback
from collections.abc import Callable
from typing import Any

import torch

from unison._coordinator.channel import Channel
from unison._ps.task.parameter_store import ParameterStore
from unison._ps.task.table_shards import TableShards
from unison._ps.wire import protocol as wire
from unison._ps.wire.links import TensorLink
from unison._ps.wire.shared_arena import MappedSegments

__all__ = ["accept_session", "serve_ps_session", "new_session", "SessionCore"]


def accept_session(channel: Channel, hello: Any) -> bool:
    """Answers a peer's opening message: ``Accepted`` for this protocol's version, else ``Refused``
    (naming both versions); returns whether the session goes on."""
    if isinstance(hello, wire.Hello) and hello.version == wire.PROTOCOL_VERSION:
        channel.send(wire.Accepted(wire.PROTOCOL_VERSION))
        return True
    theirs = hello.version if isinstance(hello, wire.Hello) else "none (an older unison)"
    channel.send(wire.Refused(f"this ps task speaks ps protocol version {wire.PROTOCOL_VERSION}, the peer "
                              f"{theirs}: run the same unison version on every task"))
    return False


@dataclasses.dataclass
class _Session:
    """What one peer's requests act on."""

    store: ParameterStore
    tables: TableShards
    shared: MappedSegments
    pulled: dict[int, torch.Tensor]  # pull buffers, reused: each is sent before the next request
    reuse_pulls: bool = True  # False for an in-process peer, which keeps what it pulled


Handler = Callable[[_Session, Any, list[torch.Tensor]], list[torch.Tensor]]


def _create(s: _Session, h: wire.Create, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    for key, value in zip(h.keys, tensors, strict=True):
        s.store.create(key, value)
    return []


def _pull(s: _Session, h: wire.Pull, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    reply = [s.store.read_into(k, s.pulled.get(i)) for i, k in enumerate(h.keys)]
    if s.reuse_pulls:
        s.pulled.update(enumerate(reply))
    return reply


def _pull_shared(s: _Session, h: wire.PullShared, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    for key, place in zip(h.keys, h.places, strict=True):
        s.store.read_to(key, s.shared.tensor(place))
    return []


def _attach(s: _Session, h: wire.Attach, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.tensor([s.shared.attach(list(h.segments))])]


def _pull_rows(s: _Session, h: wire.PullRows, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [s.store.read_rows(k, ids) for k, ids in zip(h.keys, tensors, strict=True)]


def _push(s: _Session, h: wire.Push, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    position = 0
    for entry in h.entries:
        ids = tensors[position] if entry.has_ids else None
        position += 1 if entry.has_ids else 0
        if entry.place is not None:
            s.store.apply(entry.key, s.shared.tensor(entry.place), ids, entry.optimizer, entry.hyper)
            continue
        s.store.apply(entry.key, tensors[position], ids, entry.optimizer, entry.hyper)
        position += 1
    return []


def _assign(s: _Session, h: wire.Assign, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    for key, value in zip(h.keys, tensors, strict=True):
        s.store.assign(key, value)
    return []


def _add(s: _Session, h: wire.Add, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    for key, delta in zip(h.keys, tensors, strict=True):
        s.store.add(key, delta)
    return []


def _optimizer_states(s: _Session, h: wire.OptimizerStates, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [wire.pickled([s.store.optimizer_states(key) for key in h.keys])]


def _load_optimizer_states(s: _Session, h: wire.LoadOptimizerStates, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    for key, (cls, hyper), state in zip(h.keys, h.optimizers, wire.unpickled(tensors[0]), strict=True):
        s.store.load_optimizer_state(key, cls, hyper, state)
    return []


def _ping(s: _Session, h: wire.Ping, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return []


def _table_create(s: _Session, h: wire.TableCreate, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    s.tables.create(h.key, h.config)
    return []


def _table_rows(s: _Session, h: wire.TableRows, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [s.tables.rows(h.key, tensors[0], tensors[1], h.create, h.after_step, h.wait_s, h.lookers)]


def _table_push(s: _Session, h: wire.TablePush, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    s.tables.push(h.key, tensors[0], tensors[1], h.optimizer, h.at_step, h.pushers)
    return []


def _table_pool(s: _Session, h: wire.TablePool, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [s.tables.pool(h.key, tensors[0], tensors[1], tensors[2], h.num_bags, h.create, h.after_step, h.wait_s)]


def _table_push_bags(s: _Session, h: wire.TablePushBags, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    s.tables.push_bags(h.key, tensors[0], tensors[1], tensors[2], tensors[3], h.optimizer, h.at_step, h.pushers)
    return []


def _table_export(s: _Session, h: wire.TableExport, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return wire.export_tensors(s.tables.export(h.key))


def _table_load(s: _Session, h: wire.TableLoad, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    s.tables.load(h.key, wire.export_from_tensors(tensors), h.shard, h.num_shards)
    return []


def _table_stats(s: _Session, h: wire.TableStats, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [wire.pickled(s.tables.stats())]


def _table_save_point(s: _Session, h: wire.TableSavePoint, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [wire.pickled(s.tables.save_point(h.key))]


def _table_export_delta(s: _Session, h: wire.TableExportDelta, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return wire.export_tensors(s.tables.export_delta(h.key, h.full, h.sequence))


def _table_apply_delta(s: _Session, h: wire.TableApplyDelta, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    s.tables.apply_delta(h.key, wire.export_from_tensors(tensors), h.shard, h.num_shards, (h.table_id, h.sequence))
    return []


def _table_serving_export(s: _Session, h: wire.TableServingExport,
                          tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    export = s.tables.serving_export(h.key, h.delta, h.export_id, h.number)
    return [wire.pickled(export["meta"]), export["ids"], export["rows"], export["removed"]]


_HANDLERS: dict[wire.RequestKind, Handler] = {
    wire.RequestKind.CREATE: _create,
    wire.RequestKind.PULL: _pull,
    wire.RequestKind.PULL_SHARED: _pull_shared,
    wire.RequestKind.ATTACH: _attach,
    wire.RequestKind.PULL_ROWS: _pull_rows,
    wire.RequestKind.PUSH: _push,
    wire.RequestKind.ASSIGN: _assign,
    wire.RequestKind.ADD: _add,
    wire.RequestKind.OPTIMIZER_STATES: _optimizer_states,
    wire.RequestKind.LOAD_OPTIMIZER_STATES: _load_optimizer_states,
    wire.RequestKind.PING: _ping,
    wire.RequestKind.TABLE_CREATE: _table_create,
    wire.RequestKind.TABLE_ROWS: _table_rows,
    wire.RequestKind.TABLE_PUSH: _table_push,
    wire.RequestKind.TABLE_POOL: _table_pool,
    wire.RequestKind.TABLE_PUSH_BAGS: _table_push_bags,
    wire.RequestKind.TABLE_EXPORT: _table_export,
    wire.RequestKind.TABLE_LOAD: _table_load,
    wire.RequestKind.TABLE_STATS: _table_stats,
    wire.RequestKind.TABLE_SAVE_POINT: _table_save_point,
    wire.RequestKind.TABLE_EXPORT_DELTA: _table_export_delta,
    wire.RequestKind.TABLE_APPLY_DELTA: _table_apply_delta,
    wire.RequestKind.TABLE_SERVING_EXPORT: _table_serving_export,
}
"""Every request kind's handler: ``handler(session, header, tensors) -> reply tensors``."""


def _post_table_rows(s: _Session, h: wire.TableRows,
                     tensors: list[torch.Tensor]) -> Callable[[], list[torch.Tensor]] | None:
    if not h.create or h.lookers <= 1:
        return None  # not gathered: answered as it comes
    posted = s.tables.post_rows(h.key, tensors[0], tensors[1], h.after_step, h.wait_s, h.lookers)
    return lambda: [s.tables.take_rows(posted)]


_POSTERS: dict[wire.RequestKind, Callable[[_Session, Any, list[torch.Tensor]],
                                          Callable[[], list[torch.Tensor]] | None]] = {
    wire.RequestKind.TABLE_ROWS: _post_table_rows,
}
"""Request kinds an in-process peer may post (``SessionCore.post``): ``poster(session, header, tensors)``
posts the request and returns a call that takes its reply tensors later, or None where this request
is answered as it comes."""


def new_session(store: ParameterStore, reuse_pull_buffers: bool = True) -> _Session:
    """What one peer's requests act on. ``reuse_pull_buffers=False``: every dense pull gets a tensor
    of its own (an in-process peer keeps it; over a socket it is sent before the next request)."""
    return _Session(store, store.tables, MappedSegments(), {}, reuse_pull_buffers)


def serve_ps_session(store: ParameterStore, link: TensorLink) -> None:
    """Answers one peer's requests (a worker's or the coordinator's) until it disconnects.

    Errors come back as ``Failed(exception, traceback text)``; a header that is no request of
    this protocol is such an error too (``ProtocolError`` naming what came). A request of
    ``wire.ANSWERED_ON_FAILURE`` (a row push) is answered only if it fails, and then at the
    next request that has a reply, which is not applied (nor any push in between): the peer
    raises the push's error there, before it builds on the push.
    """
    session = new_session(store)
    try:
        _serve(session, link)
    finally:
        session.shared.close()


class SessionCore:
    """One peer's requests answered in order: the part of a session that is not its transport.

    A request of ``wire.ANSWERED_ON_FAILURE`` (a row push) gets no answer when it succeeds; when
    it fails, its ``Failed`` answers the next request that has a reply, which is not applied
    (nor any push in between). Shared by the socket session (:func:`serve_ps_session`) and
    the in-process link (:mod:`unison._ps.task.in_process_link`).
    """

    def __init__(self, session: _Session):
        self._session = session
        self._ok = wire.Ok()
        self._failed: wire.Failed | None = None  # an unanswered push's failure, not reported yet

    def post(self, header: Any,
             tensors: list[torch.Tensor]) -> Callable[[], tuple[wire.Ok | wire.Failed, list[torch.Tensor]]] | None:
        """A request its kind's poster (``_POSTERS``: a gathered training lookup) posts to its shard now,
        and a call that takes its answer later; None for any other request, or while a push's
        failure waits to be reported (:meth:`answer` it)."""
        if self._failed is not None:
            return None
        try:
            request = wire.check_request(header)
        except wire.ProtocolError:
            return None  # answer() reports what came
        poster = _POSTERS.get(request.KIND)
        if poster is None:
            return None
        try:
            take = poster(self._session, request, tensors)
        except Exception as e:  # as answer() would: the requester raises it
            failed: tuple[wire.Failed, list[torch.Tensor]] = (wire.Failed(e, traceback.format_exc()), [])
            return lambda: failed
        if take is None:
            return None

        def answer_later() -> tuple[wire.Ok | wire.Failed, list[torch.Tensor]]:
            try:
                return self._ok, take()
            except Exception as e:
                return wire.Failed(e, traceback.format_exc()), []
        return answer_later

    def answer(self, header: Any,
               tensors: list[torch.Tensor]) -> tuple[wire.Ok | wire.Failed, list[torch.Tensor]] | None:
        """Applies one request; its answer and reply tensors, or None when it has none."""
        quiet = False
        message: wire.Ok | wire.Failed
        try:
            request = wire.check_request(header)
            quiet = request.KIND in wire.ANSWERED_ON_FAILURE
            if self._failed is not None:
                if quiet:
                    return None
                message, reply, self._failed = self._failed, [], None
            else:
                reply = _HANDLERS[request.KIND](self._session, request, tensors)
                message = self._ok
        except Exception as e:  # sent back to the requester, which raises it
            message, reply = wire.Failed(e, traceback.format_exc(), earlier=quiet), []
        if quiet:
            if isinstance(message, wire.Failed):
                self._failed = message
            return None
        return message, reply


def _serve(session: _Session, link: TensorLink) -> None:
    core = SessionCore(session)
    while True:
        try:
            header, tensors = link.recv(reuse=True)  # every request is done with them before the next
        except (EOFError, OSError):
            return
        answer = core.answer(header, tensors)
        if answer is None:
            continue
        message, reply = answer
        try:
            link.send(message, reply)
        except (EOFError, OSError):
            return
        except Exception as e:  # the error itself could not be pickled
            link.send(wire.Failed(RuntimeError(repr(e)), "", isinstance(message, wire.Failed) and message.earlier), [])
