"""The ps wire protocol: every request a worker or the chief sends a ps task, and its replies.

Both sides import this one module. A request is a header (one frozen dataclass per kind
below, its kind an enum member) followed by raw tensor frames (:mod:`~unison.ps.wire.links`);
a reply is :class:`Ok` or :class:`Failed` with tensors. The ps task dispatches on the
header's class through one table (:mod:`unison.ps.task.sessions`), so adding a request is a
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
``TableRows(key, create)``    distinct ids, their occurrences            rows
``TablePush(key, optimizer)`` ids, grads                                 none
``TablePool(key, create, n)`` ids, bag of each id, weights               a partial row per bag
``TablePushBags(...)``        ids, bag of each id, weights, bag grads    none
``TableExport(key)``          none                                       the export's tensors
``TableLoad(key, shard, n)``  an export's tensors                        none
``TableStats()``              none                                       the pickled stats
============================  =========================================  ==========================
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import pickle
from typing import Any

import cloudpickle
import torch

__all__ = [
    "PROTOCOL_VERSION", "RequestKind", "Request", "Hello", "Accepted", "Refused", "Ok", "Failed", "PushEntry",
    "Create", "Pull", "PullShared", "Attach", "PullRows", "Push", "Assign", "Add", "OptimizerStates",
    "LoadOptimizerStates", "Ping", "TableCreate", "TableRows", "TablePush", "TablePool", "TablePushBags",
    "TableExport", "TableLoad", "TableStats", "ProtocolError", "check_request", "export_tensors",
    "export_from_tensors", "pickled", "unpickled", "RunFunction", "BuildDataset", "FunctionResult",
    "FunctionFailed", "WorkerRequest",
]

PROTOCOL_VERSION = 2
"""Bumped whenever a header changes (1 was the positional tuples of unison <= 0.1)."""


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


class Request(abc.ABC):
    """Base of every request header; ``KIND`` names it (a class attribute of each header)."""

    __slots__ = ()

    @property
    @abc.abstractmethod
    def KIND(self) -> RequestKind:  # noqa: N802 - a constant of each header class
        """Which request this header is."""


# -- the session ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True)
class Hello:
    """Opens a ps session: the requester's protocol version."""

    version: int


@dataclasses.dataclass(frozen=True, slots=True)
class Accepted:
    """The ps task speaks the requester's version."""

    version: int


@dataclasses.dataclass(frozen=True, slots=True)
class Refused:
    """The ps task does not: why, with both versions."""

    reason: str


# -- replies ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True)
class Ok:
    """The request was applied; its tensors follow."""


@dataclasses.dataclass(frozen=True, slots=True)
class Failed:
    """The request raised on the ps task: the exception (re-raised by the requester) and its traceback."""

    error: BaseException
    traceback: str


# -- variables --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True)
class Create(Request):
    KIND = RequestKind.CREATE
    keys: tuple[str, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Pull(Request):
    KIND = RequestKind.PULL
    keys: tuple[str, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class PullShared(Request):
    """Each value copied by the ps task into the worker's shared memory at ``places``."""

    KIND = RequestKind.PULL_SHARED
    keys: tuple[str, ...]
    places: tuple[Any, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Attach(Request):
    """Map the worker's shared-memory segments (same host only; see ``shared_arena``)."""

    KIND = RequestKind.ATTACH
    segments: tuple[Any, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class PullRows(Request):
    KIND = RequestKind.PULL_ROWS
    keys: tuple[str, ...]


@dataclasses.dataclass(frozen=True, slots=True)
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


@dataclasses.dataclass(frozen=True, slots=True)
class Push(Request):
    KIND = RequestKind.PUSH
    entries: tuple[PushEntry, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Assign(Request):
    KIND = RequestKind.ASSIGN
    keys: tuple[str, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Add(Request):
    KIND = RequestKind.ADD
    keys: tuple[str, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class OptimizerStates(Request):
    KIND = RequestKind.OPTIMIZER_STATES
    keys: tuple[str, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class LoadOptimizerStates(Request):
    """Per key, the optimizer class and hyper-parameters whose state the pickled tensor holds."""

    KIND = RequestKind.LOAD_OPTIMIZER_STATES
    keys: tuple[str, ...]
    optimizers: tuple[tuple[type, dict], ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Ping(Request):
    KIND = RequestKind.PING


# -- dynamic tables ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True)
class TableCreate(Request):
    """Make the table's shard, or check an existing one was made from the same config."""

    KIND = RequestKind.TABLE_CREATE
    key: str
    config: Any


@dataclasses.dataclass(frozen=True, slots=True)
class TableRows(Request):
    KIND = RequestKind.TABLE_ROWS
    key: str
    create: bool


@dataclasses.dataclass(frozen=True, slots=True)
class TablePush(Request):
    KIND = RequestKind.TABLE_PUSH
    key: str
    optimizer: Any


@dataclasses.dataclass(frozen=True, slots=True)
class TablePool(Request):
    KIND = RequestKind.TABLE_POOL
    key: str
    create: bool
    num_bags: int


@dataclasses.dataclass(frozen=True, slots=True)
class TablePushBags(Request):
    KIND = RequestKind.TABLE_PUSH_BAGS
    key: str
    optimizer: Any


@dataclasses.dataclass(frozen=True, slots=True)
class TableExport(Request):
    KIND = RequestKind.TABLE_EXPORT
    key: str


@dataclasses.dataclass(frozen=True, slots=True)
class TableLoad(Request):
    """Replace the shard by the rows of an export that belong to shard ``shard`` of ``num_shards``."""

    KIND = RequestKind.TABLE_LOAD
    key: str
    shard: int
    num_shards: int


@dataclasses.dataclass(frozen=True, slots=True)
class TableStats(Request):
    KIND = RequestKind.TABLE_STATS


# -- the chief and a worker (a ClusterCoordinator's session with a worker task) ---------------
@dataclasses.dataclass(frozen=True, slots=True)
class RunFunction:
    """Run a scheduled function: ``(fn, args, kwargs)`` pickled by ``dumps_for_workers``."""

    payload: bytes


@dataclasses.dataclass(frozen=True, slots=True)
class BuildDataset:
    """Build per-worker dataset ``dataset_id`` by calling ``dataset_fn`` on the worker."""

    dataset_id: int
    dataset_fn: Any


@dataclasses.dataclass(frozen=True, slots=True)
class FunctionResult:
    """What the function (or dataset build) returned."""

    value: Any


@dataclasses.dataclass(frozen=True, slots=True)
class FunctionFailed:
    """What it raised, its traceback on the worker, and whether the worker lost a ps task
    (then nothing can run any more)."""

    error: BaseException
    traceback: str
    lost_ps: bool


WorkerRequest = RunFunction | BuildDataset


def check_request(header: Any) -> Request:
    """``header`` if it is a request of this protocol.

    Raises:
        ProtocolError: naming what came instead (a peer of another unison version, or not unison).
    """
    if isinstance(header, Request):
        return header
    kind = header[0] if isinstance(header, tuple) and header and isinstance(header[0], str) else type(header).__name__
    raise ProtocolError(f"malformed ps request {kind!r}: expected one of {[k.value for k in RequestKind]} as a "
                        f"header of unison.ps.wire.protocol (version {PROTOCOL_VERSION}); is the peer another unison "
                        f"version?")


# -- payload codecs ---------------------------------------------------------------------------
def pickled(value: Any) -> torch.Tensor:
    """``value`` pickled into a uint8 tensor, for what travels best as bytes (optimizer states)."""
    return torch.frombuffer(bytearray(cloudpickle.dumps(value)), dtype=torch.uint8)


def unpickled(data: torch.Tensor) -> Any:
    """The value ``pickled`` made."""
    return pickle.loads(data.numpy().tobytes())


def export_tensors(export: dict[str, Any]) -> list[torch.Tensor]:
    """A table export as tensors for a link: meta and state names pickled first, then the columns."""
    names = sorted(export["state"])
    head = pickled((export["meta"], names))
    return [head, export["ids"], export["rows"], export["counts"], export["last_seen"],
            *(export["state"][name] for name in names)]


def export_from_tensors(tensors: list[torch.Tensor]) -> dict[str, Any]:
    """The export ``export_tensors`` sent."""
    meta, names = unpickled(tensors[0])
    ids, rows, counts, last_seen = tensors[1:5]
    return {"ids": ids, "rows": rows, "counts": counts, "last_seen": last_seen, "meta": meta,
            "state": dict(zip(names, tensors[5:]))}
