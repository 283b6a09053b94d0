"""The ps wire is typed: request kinds are an enum, each header a frozen dataclass, one dispatch table.

A request added on one side only, a kind without a handler, or a string-keyed
``kind == "..."`` branch creeping back into ``unison._ps`` fails here; so does a
malformed request or a peer of another protocol version getting further than an error
naming it.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

import unison
from unison._ps.task import sessions
from unison._ps.wire import protocol as wire

PS_ROOT = Path(unison.__file__).parent / "_ps"


def _request_classes() -> list[type]:
    return [obj for obj in vars(wire).values() if isinstance(obj, type) and issubclass(obj, wire.Request)
            and obj is not wire.Request]


def test_each_request_kind_has_one_frozen_header_and_one_handler():
    classes = _request_classes()
    assert sorted(c.KIND.value for c in classes) == sorted(k.value for k in wire.RequestKind)
    for cls in classes:
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, cls
    assert set(sessions._HANDLERS) == set(wire.RequestKind)


def _string_kind_branches(tree: ast.AST) -> list[int]:
    """Lines that compare a name like ``kind``/``header[0]`` with a string literal."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(isinstance(c, ast.Constant) and isinstance(c.value, str)
                                                 for c in node.comparators):
            left = ast.unparse(node.left)
            if "kind" in left or left.endswith("[0]"):
                lines.append(node.lineno)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "startswith":
            if "kind" in ast.unparse(node.func.value):
                lines.append(node.lineno)
    return lines


def test_no_string_keyed_request_branches_in_ps():
    found = {path.relative_to(PS_ROOT).as_posix(): lines for path in PS_ROOT.rglob("*.py")
             if (lines := _string_kind_branches(ast.parse(path.read_text())))}
    assert not found, f"string-keyed request branches (use unison._ps.wire.protocol's types): {found}"


def test_the_branch_scan_catches_one():
    tree = ast.parse('if kind == "pull":\n    pass\nif header[0] == "error":\n    pass\nkind.startswith("table_")')
    assert _string_kind_branches(tree) == [1, 3, 5]


def test_a_malformed_request_is_refused_naming_it():
    with pytest.raises(wire.ProtocolError, match=r"malformed ps request 'pull'.*version"):
        wire.check_request(("pull", ["w"]))
    with pytest.raises(wire.ProtocolError, match=r"malformed ps request 'dict'"):
        wire.check_request({"kind": "pull"})
    assert wire.check_request(wire.Ping()) == wire.Ping()


class _Channel:
    def __init__(self):
        self.sent = []

    def send(self, message):
        self.sent.append(message)


@pytest.mark.parametrize("hello", [None, wire.Hello(wire.PROTOCOL_VERSION - 1), wire.Hello(wire.PROTOCOL_VERSION + 7)])
def test_another_protocol_version_is_refused_at_the_handshake(hello):
    channel = _Channel()
    assert sessions.accept_session(channel, hello) is False
    (answer,) = channel.sent
    assert isinstance(answer, wire.Refused)
    assert f"version {wire.PROTOCOL_VERSION}" in answer.reason
    assert "same unison version" in answer.reason


def test_the_same_version_is_accepted():
    channel = _Channel()
    assert sessions.accept_session(channel, wire.Hello(wire.PROTOCOL_VERSION)) is True
    assert channel.sent == [wire.Accepted(wire.PROTOCOL_VERSION)]


def _example(cls: type):
    """One instance of each message class, with fields of the kinds that travel."""
    import torch

    from unison._embeddings.optim.row_optimizers import RowSGD
    from unison._embeddings.tables.initializers import normal
    from unison._embeddings.tables.table import TableConfig

    values = {
        "keys": ("a", "b"), "places": (None,), "segments": (("seg", 16),), "entries":
            (wire.PushEntry("a", True, torch.optim.SGD, {"lr": 0.1}), wire.PushEntry("b", False, torch.optim.Adam, {})),
        "optimizers": ((torch.optim.SGD, {"lr": 0.1}),), "key": "t",
        "config": TableConfig(4, torch.float32, normal(), 0, None),
        "create": True, "optimizer": RowSGD(lr=0.5), "num_bags": 3, "shard": 1, "num_shards": 2, "version": 2,
        "reason": "why", "error": ValueError("bad"), "traceback": "tb", "earlier": True, "payload": b"x",
        "dataset_id": 1, "dataset_fn": len, "value": 7, "lost_ps": False, "place": None, "has_ids": True,
        "hyper": {"lr": 0.1},
        "full": False, "at_step": 5, "pushers": 2, "after_step": 4, "wait_s": 1.5, "lookers": 2, "sequence": 3,
        "table_id": "0f3a",
        "delta": True, "export_id": "9c1d", "number": 2, "replies_apart": True,
    }
    return cls(*(values[name] for name in cls.__slots__))


@pytest.mark.parametrize("cls", wire._MESSAGES, ids=lambda c: c.__name__)
def test_every_message_crosses_the_wire_whole(cls):
    import pickle

    message = _example(cls)
    header, meta = pickle.loads(wire.dumps_header(message, [((2,), "meta")]))
    got = wire.decode(header)
    assert type(got) is cls and meta == [((2,), "meta")]
    assert repr(got) == repr(message)  # field by field (an exception or optimizer compares by identity)


def test_a_message_of_an_unknown_code_is_refused():
    with pytest.raises(wire.ProtocolError, match="unknown ps message code 999"):
        wire.decode((wire._TAG, 999, ()))
