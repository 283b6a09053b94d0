"""The ps wire protocol: every request a worker or the chief sends a ps task, and its replies.

Both sides import this one module. A request is a header (one frozen dataclass per kind
below, its kind an enum member) followed by raw tensor frames (:mod:`~unison._ps.wire.links`);
a reply is :class:`Ok` or :class:`Failed` with tensors. A row push (``TablePush``,
``TablePushBags``: :data:`ANSWERED_ON_FAILURE`) has no reply when it succeeds; a push that
fails is answered at the session's next request that has a reply, by its ``Failed`` (marked
``earlier``), and that request is not applied. The ps task dispatches on the
header's class through one table (:mod:`unison._ps.task.sessions`), so adding a request is a
dataclass here, a method on the client side and one handler there.

A session opens with :class:`Hello` carrying :data:`PROTOCOL_VERSION`; a ps task speaking
another version answers :class:`Refused` and closes, so a worker and a ps task of different
unison versions fail at the handshake with both versions named, not at the first odd request.

The table export codec (:func:`export_tensors` / :func:`export_from_tensors`) is here too:
an export crosses the wire in a checkpoint load or save.

Requests (header + tensors -> reply tensors):

============================  =========================================  ==========================
header                        tensors sent                               tensors back
============================  =========================================  ==========================
``Create(keys)``              a value per key                            none
``Pull(keys)``                none                                       a value per key
``PullShared(keys, places)``  none (copied into the worker's memory)      none
``Attach(segments)``          none                                       one bool: segments mapped
``PullRows(keys)``            local row ids per key                      rows per key
``Push(entries)``             per entry: [ids] [grad unless placed]      none
``Assign(keys)``              a value per key                            none
``Add(keys)``                 a delta per key                            none
``OptimizerStates(keys)``     none                                       the pickled states
``LoadOptimizerStates(...)``  the pickled states                         none
``Ping()``                    none                                       none
``TableCreate(key, config)``  none                                       none
``TableRows(key, create..)``  distinct ids, their occurrences            rows
``TablePush(key, opt..)``     ids, grads                                 (no reply)
``TablePool(key, create..)``  ids, bag of each id, weights               a partial row per bag
``TablePushBags(...)``        ids, bag of each id, weights, bag grads    (no reply)
``TableExport(key)``          none                                       the export's tensors
``TableLoad(key, shard, n)``  an export's tensors                        none
``TableStats()``              none                                       the pickled stats
``TableSavePoint(key)``       none                                       the pickled save point
``TableExportDelta(...)``     none                                       the delta's tensors
``TableApplyDelta(...)``      a delta's tensors                          none
``TableServingExport(...)``   none                                       meta, ids, rows, removed
============================  =========================================  ==========================
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import pickle
import typing
from typing import Any

import cloudpickle
import torch

__all__ = [
    "PROTOCOL_VERSION", "RequestKind", "Request", "Hello", "Accepted", "Refused", "Ok", "Failed", "PushEntry",
    "Create", "Pull", "PullShared", "Attach", "PullRows", "Push", "Assign", "Add", "OptimizerStates",
    "LoadOptimizerStates", "Ping", "TableCreate", "TableRows", "TablePush", "TablePool", "TablePushBags",
    "TableExport", "TableLoad", "TableStats", "TableSavePoint", "TableExportDelta", "TableApplyDelta",
    "TableServingExport", "ANSWERED_ON_FAILURE", "ProtocolError", "check_request", "encode", "decode", "dumps_header",
    "export_tensors", "export_from_tensors", "pickled", "unpickled", "RunFunction", "BuildDataset", "FunctionResult",
    "FunctionFailed", "WorkerRequest",
]

PROTOCOL_VERSION = 10
"""Bumped whenever a header changes (1 was the positional tuples of unison <= 0.1; 3: a table
export carries its policy parts, and ``TableCreate``'s config its admission and capacity; 4: delta
checkpoints and serving exports of a table, and an export's ``removed`` ids; 5: a table config's disk tier, ``storage``,
which an older ps task would drop, keeping every row in memory; 6: a table push's ``at_step``,
the global step of a synchronous job's push; 7: row pushes have no reply unless they fail, and
``Failed.earlier``; 8: a synchronous push's ``pushers`` (the shard sums a global step's pushes and
applies them once) and a lookup's ``after_step`` and ``wait_s``; 9: a lookup's ``lookers``, whose lookups of
a global step the shard makes as one; 10: ``Hello.replies_apart``, a same-host session's replies
on a socket of their own, handed to the ps task after ``Accepted``)."""


class ProtocolError(ValueError):
    """A message that is not a request of this protocol, or a peer of another version."""


class RequestKind(enum.Enum):
    """Every request a ps task answers."""

    CREATE = "create"
    PULL = "pull"
    PULL_SHARED = "pull_shared"
    ATTACH = "attach"
    PULL_ROWS = "pull_rows"
    PUSH = "push"
    ASSIGN = "assign"
    ADD = "add"
    OPTIMIZER_STATES = "optimizer_states"
    LOAD_OPTIMIZER_STATES = "load_optimizer_states"
    PING = "ping"
    TABLE_CREATE = "table_create"
    TABLE_ROWS = "table_rows"
    TABLE_PUSH = "table_push"
    TABLE_POOL = "table_pool"
    TABLE_PUSH_BAGS = "table_push_bags"
    TABLE_EXPORT = "table_export"
    TABLE_LOAD = "table_load"
    TABLE_STATS = "table_stats"
    TABLE_SAVE_POINT = "table_save_point"
    TABLE_EXPORT_DELTA = "table_export_delta"
    TABLE_APPLY_DELTA = "table_apply_delta"
    TABLE_SERVING_EXPORT = "table_serving_export"


_MESSAGES: list[type] = []
"""Every message class, by its code on the wire (its position)."""
_CODES: dict[type, int] = {}


@typing.dataclass_transform(frozen_default=True)
def _message(cls: type) -> type:
    """A frozen dataclass with slots, numbered for :func:`encode`."""
    cls = dataclasses.dataclass(frozen=True, slots=True)(cls)
    _CODES[cls] = len(_MESSAGES)
    _MESSAGES.append(cls)
    return cls


_TAG = "unison._ps.wire"


def encode(message: Any) -> Any:
    """A protocol message as a tuple of its code and field values (anything else as it is).

    A header crosses the wire with every request and reply. Pickled as an object, each
    message class (and a ``PushEntry`` per gradient) is a class reference that cloudpickle
    looks up anew every time: measured, 3-4 us per class and message, 9% of the ps
    benchmark's embedding workload. As a tuple it pickles as the old positional headers did.
    """
    code = _CODES.get(type(message))
    if code is None:
        return message
    if code == _PUSH_CODE:
        return _TAG, code, tuple([(e.key, e.has_ids, e.optimizer, e.hyper, e.place) for e in message.entries])
    return _TAG, code, tuple([getattr(message, name) for name in message.__slots__])


def dumps_header(header: Any, meta: Any) -> bytes:
    """``(header, meta)`` as bytes for a link: a message whose fields are unison's or builtins
    by the C pickler; anything that may hold a user's class (a dense push's optimizer class,
    a table's initializer, an exception, a non-protocol header) by cloudpickle, which can
    send a class defined in ``__main__``. The C pickler is 2-3x faster per message, and
    the lookups, pushes and their replies of a recommendation model are hundreds a step."""
    encoded = encode(header)
    if type(header) in _PLAIN:
        return pickle.dumps((encoded, meta), protocol=pickle.HIGHEST_PROTOCOL)
    return cloudpickle.dumps((encoded, meta))


def decode(value: Any) -> Any:
    """The message :func:`encode` made (anything else as it is)."""
    if type(value) is not tuple or len(value) != 3 or value[0] != _TAG:
        return value
    code, fields = value[1], value[2]
    if not 0 <= code < len(_MESSAGES):
        raise ProtocolError(f"unknown ps message code {code}: is the peer another unison version?")
    if code == _PUSH_CODE:
        return Push(tuple([PushEntry(*entry) for entry in fields]))
    return _MESSAGES[code](*fields)


class Request(abc.ABC):
    """Base of every request header; ``KIND`` names it (a class attribute of each header)."""

    __slots__ = ()

    @property
    @abc.abstractmethod
    def KIND(self) -> RequestKind:  # noqa: N802 - a constant of each header class
        """Which request this header is."""


# -- the session ------------------------------------------------------------------------------
@_message
class Hello:
    """Opens a ps session: the requester's protocol version; ``replies_apart``: on a same-host
    link, the replies go on a socket of their own that the requester hands over after
    ``Accepted`` (``unison._ps.wire.links.open_link``)."""

    version: int
    replies_apart: bool = False


@_message
class Accepted:
    """The ps task speaks the requester's version."""

    version: int


@_message
class Refused:
    """The ps task does not: why, with both versions."""

    reason: str


# -- replies ----------------------------------------------------------------------------------
@_message
class Ok:
    """The request was applied; its tensors follow."""


@_message
class Failed:
    """The request raised on the ps task: the exception (re-raised by the requester) and its traceback.

    ``earlier``: it was an earlier request of the session, one of :data:`ANSWERED_ON_FAILURE`; the
    request this answers was not applied."""

    error: BaseException
    traceback: str
    earlier: bool = False


# -- variables --------------------------------------------------------------------------------
@_message
class Create(Request):
    KIND = RequestKind.CREATE
    keys: tuple[str, ...]


@_message
class Pull(Request):
    KIND = RequestKind.PULL
    keys: tuple[str, ...]


@_message
class PullShared(Request):
    """Each value copied by the ps task into the worker's shared memory at ``places``."""

    KIND = RequestKind.PULL_SHARED
    keys: tuple[str, ...]
    places: tuple[Any, ...]


@_message
class Attach(Request):
    """Map the worker's shared-memory segments (same host only; see ``shared_arena``)."""

    KIND = RequestKind.ATTACH
    segments: tuple[Any, ...]


@_message
class PullRows(Request):
    KIND = RequestKind.PULL_ROWS
    keys: tuple[str, ...]


@_message
class PushEntry:
    """One gradient of a :class:`Push`: its variable, the optimizer to apply, and where it is.

    ``has_ids``: the gradient is of rows (their local ids come first among its tensors);
    ``place``: a dense gradient read from the worker's shared memory instead of sent.
    """

    key: str
    has_ids: bool
    optimizer: type
    hyper: dict
    place: Any = None


@_message
class Push(Request):
    KIND = RequestKind.PUSH
    entries: tuple[PushEntry, ...]


@_message
class Assign(Request):
    KIND = RequestKind.ASSIGN
    keys: tuple[str, ...]


@_message
class Add(Request):
    KIND = RequestKind.ADD
    keys: tuple[str, ...]


@_message
class OptimizerStates(Request):
    KIND = RequestKind.OPTIMIZER_STATES
    keys: tuple[str, ...]


@_message
class LoadOptimizerStates(Request):
    """Per key, the optimizer class and hyper-parameters whose state the pickled tensor holds."""

    KIND = RequestKind.LOAD_OPTIMIZER_STATES
    keys: tuple[str, ...]
    optimizers: tuple[tuple[type, dict], ...]


@_message
class Ping(Request):
    KIND = RequestKind.PING


# -- dynamic tables ---------------------------------------------------------------------------
@_message
class TableCreate(Request):
    """Make the table's shard, or check an existing one was made from the same config."""

    KIND = RequestKind.TABLE_CREATE
    key: str
    config: Any


@_message
class TableRows(Request):
    KIND = RequestKind.TABLE_ROWS
    key: str
    create: bool
    after_step: int = 0  # answered once the shard applied this global step (the worker's pushes so far)...
    wait_s: float = 0.0  # ...waiting at most this long for the other workers' pushes of it
    lookers: int = 1  # synchronous training: the workers whose lookups after that step the shard makes as one


@_message
class TablePush(Request):
    KIND = RequestKind.TABLE_PUSH
    key: str
    optimizer: Any
    at_step: int | None  # a synchronous job's global step (the hybrid strategy), else None: one per push
    pushers: int = 1  # synchronous: the workers that push every global step, whose pushes the shard sums


@_message
class TablePool(Request):
    KIND = RequestKind.TABLE_POOL
    key: str
    create: bool
    num_bags: int
    after_step: int = 0
    wait_s: float = 0.0


@_message
class TablePushBags(Request):
    KIND = RequestKind.TABLE_PUSH_BAGS
    key: str
    optimizer: Any
    at_step: int | None
    pushers: int = 1


@_message
class TableExport(Request):
    KIND = RequestKind.TABLE_EXPORT
    key: str


@_message
class TableLoad(Request):
    """Replace the shard by the rows of an export that belong to shard ``shard`` of ``num_shards``."""

    KIND = RequestKind.TABLE_LOAD
    key: str
    shard: int
    num_shards: int


@_message
class TableStats(Request):
    KIND = RequestKind.TABLE_STATS


@_message
class TableSavePoint(Request):
    """Where the shard's delta and serving chains stand (``LocalTable.save_point``)."""

    KIND = RequestKind.TABLE_SAVE_POINT
    key: str


@_message
class TableExportDelta(Request):
    """A new save point of the shard, which must be at save ``sequence``: its delta, or all of it (``full``)."""

    KIND = RequestKind.TABLE_EXPORT_DELTA
    key: str
    full: bool
    sequence: int


@_message
class TableApplyDelta(Request):
    """Apply a delta's rows of shard ``shard`` of ``num_shards``; the shard must be table ``table_id`` at
    save ``sequence`` (what its owner read and checked against the delta)."""

    KIND = RequestKind.TABLE_APPLY_DELTA
    key: str
    shard: int
    num_shards: int
    table_id: str
    sequence: int


@_message
class TableServingExport(Request):
    """The shard's ids and rows for serving: all (a chain ``export_id`` starts) or those changed since
    export ``number`` (``delta``)."""

    KIND = RequestKind.TABLE_SERVING_EXPORT
    key: str
    delta: bool
    export_id: str
    number: int


ANSWERED_ON_FAILURE = frozenset({RequestKind.TABLE_PUSH, RequestKind.TABLE_PUSH_BAGS})
"""Requests with no reply when they succeed: a worker's row pushes, two per ps task and step, sent
without waiting. An ``Ok`` for each cost the ps task a send and the worker a read, and the worker
could not send its next lookup before that ``Ok`` had come (one more sleep and wake of each a
step, on a machine where a wake costs tens of microseconds)."""


# -- the chief and a worker (a ClusterCoordinator's session with a worker task) ---------------
@_message
class RunFunction:
    """Run a scheduled function: ``(fn, args, kwargs)`` pickled by ``dumps_for_workers``."""

    payload: bytes


@_message
class BuildDataset:
    """Build per-worker dataset ``dataset_id`` by calling ``dataset_fn`` on the worker."""

    dataset_id: int
    dataset_fn: Any


@_message
class FunctionResult:
    """What the function (or dataset build) returned."""

    value: Any


@_message
class FunctionFailed:
    """What it raised, its traceback on the worker, and whether the worker lost a ps task
    (then nothing can run any more)."""

    error: BaseException
    traceback: str
    lost_ps: bool


WorkerRequest = RunFunction | BuildDataset


_PUSH_CODE = _CODES[Push]

_PLAIN = frozenset({Hello, Accepted, Refused, Ok, Create, Pull, PullShared, Attach, PullRows, Assign, Add,
                    OptimizerStates, Ping, TableRows, TablePush, TablePool, TablePushBags, TableExport, TableLoad,
                    TableStats, TableSavePoint, TableExportDelta, TableApplyDelta, TableServingExport})
"""Messages whose fields are builtins, tensors' metadata or unison's own objects (a table's row
optimizer): the C pickler takes them. ``Push``, ``LoadOptimizerStates`` (optimizer classes),
``TableCreate`` (an initializer), ``Failed`` (an exception) and the chief's messages may hold a
user's class: cloudpickle."""


def check_request(header: Any) -> Request:
    """``header`` if it is a request of this protocol.

    Raises:
        ProtocolError: naming what came instead (a peer of another unison version, or not unison).
    """
    if isinstance(header, Request):
        return header
    kind = header[0] if isinstance(header, tuple) and header and isinstance(header[0], str) else type(header).__name__
    raise ProtocolError(f"malformed ps request {kind!r}: expected one of {[k.value for k in RequestKind]} as a "
                        f"header of unison._ps.wire.protocol (version {PROTOCOL_VERSION}); is the peer another unison "
                        f"version?")


# -- payload codecs ---------------------------------------------------------------------------
def pickled(value: Any) -> torch.Tensor:
    """``value`` pickled into a uint8 tensor, for what travels best as bytes (optimizer states)."""
    return torch.frombuffer(bytearray(cloudpickle.dumps(value)), dtype=torch.uint8)


def unpickled(data: torch.Tensor) -> Any:
    """The value ``pickled`` made."""
    return pickle.loads(data.numpy().tobytes())


_EXPORT_POLICY_KEYS = ("idle_seconds", "pending_counts", "removed")
"""A table's optional policy state (``checks.POLICY_KEYS``), and a delta's removed ids."""


def export_tensors(export: dict[str, Any]) -> list[torch.Tensor]:
    """A table export as tensors for a link: meta, state names and the policy parts present pickled
    first, then the columns, the states and the policy parts."""
    names = sorted(export["state"])
    policy = [key for key in _EXPORT_POLICY_KEYS if export.get(key) is not None]
    head = pickled((export["meta"], names, policy))
    return [head, export["ids"], export["rows"], export["counts"], export["last_seen"],
            *(export["state"][name] for name in names), *(export[key] for key in policy)]


def export_from_tensors(tensors: list[torch.Tensor]) -> dict[str, Any]:
    """The export ``export_tensors`` sent."""
    meta, names, policy = unpickled(tensors[0])
    ids, rows, counts, last_seen = tensors[1:5]
    states = tensors[5:5 + len(names)]
    return {"ids": ids, "rows": rows, "counts": counts, "last_seen": last_seen, "meta": meta,
            "state": dict(zip(names, states)), **dict(zip(policy, tensors[5 + len(names):]))}
