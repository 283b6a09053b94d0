"""``unison serve-embeddings``: an ``EmbeddingServer`` answers lookups of a ``ServingFollower``'s tables over HTTP.

In one process: a ``ServingExporter`` writes snapshots of a small trained model, the server
follows them and ``urllib`` asks it; rows are compared bit for bit with the training
table's (float32 values read back from JSON). One subprocess runs the command itself, to
see it listen, stop on SIGTERM with exit 0, and import no training code.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import unison
from tests.embeddings._ranker import Ranker, make, train
from unison._embeddings.serving.http_server import EmbeddingServer
from unison._embeddings.serving.serving_embedding import ServingEmbedding
from unison._launch import cli
from unison.embeddings import ServingExporter

pytestmark = pytest.mark.timeout(60)


def exporter_of(model: Ranker, root: Path) -> ServingExporter:
    return ServingExporter(root, {"users": model.users, "items": model.items}, dense=model, every_seconds=3600.0)


def request(server: EmbeddingServer, path: str, body: object = None, raw: bytes | None = None) -> tuple[int, Any]:
    """(status, decoded JSON answer) of a GET (no body) or POST to ``path``."""
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(server.url + path, data=data), timeout=20) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        with error:
            assert error.headers["Content-Type"] == "application/json"
            return error.code, json.loads(error.read())


def served_rows(server: EmbeddingServer, table: str, ids: torch.Tensor) -> torch.Tensor:
    status, answer = request(server, "/lookup", {"table": table, "ids": ids.tolist()})
    assert status == 200, answer
    assert len(answer["rows"]) == ids.numel() > 0
    return torch.tensor(answer["rows"], dtype=torch.float32)


def assert_bitwise(served: torch.Tensor, trained: torch.Tensor) -> None:
    """Equal bit for bit: -0.0 against 0.0 counts as a difference."""
    assert served.dtype == trained.dtype == torch.float32 and served.shape == trained.shape
    assert torch.equal(served.view(torch.int32), trained.view(torch.int32))


def assert_serves(server: EmbeddingServer, model: Ranker) -> None:
    for name in ("users", "items"):
        state = getattr(model, name).state_dict()
        assert_bitwise(served_rows(server, name, state["ids"]), state["rows"])


@pytest.fixture
def serving(tmp_path: Path) -> Iterator[tuple[EmbeddingServer, list[str]]]:
    """A started server on ``tmp_path`` that polls only when asked (after its first poll), and its log."""
    lines: list[str] = []
    server = EmbeddingServer(tmp_path, poll_seconds=3600.0, log=lines.append).start()
    try:
        yield server, lines
    finally:
        server.stop()


def wait_for(condition, what: str, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {seconds} s"
        time.sleep(0.02)


def test_lookup_answers_the_trained_rows_bit_for_bit_and_each_delta_once_polled(tmp_path, serving):
    server, lines = serving
    model, opt = make()
    exporter = exporter_of(model, tmp_path)
    train(model, opt, 3, seed=0)
    state = model.users.state_dict()
    state["rows"][0, 0] = -0.0  # a row as stored, not pooled: a sum of one id would serve 0.0
    model.users.load_state_dict(state)
    exporter.export(info={"step": 3})
    assert [s.number for s in server.poll()] in ([0], [])  # [] when the background thread's first poll took it
    assert_serves(server, model)
    status, answer = request(server, "/status")
    assert status == 200, answer
    assert answer["snapshot"]["number"] == 0 and answer["snapshot"]["kind"] == "full"
    assert answer["snapshot"]["chain"] == 0 and answer["snapshot"]["info"] == {"step": 3}
    assert answer["snapshot"]["lag"] >= 0 and answer["poll_error"] is None and answer["root"] == str(tmp_path)
    assert answer["tables"] == {"users": {"rows": model.users.state_dict()["ids"].numel(), "dim": 4, "mode": "sum"},
                                "items": {"rows": model.items.state_dict()["ids"].numel(), "dim": 4, "mode": None}}

    old = model.users.state_dict()
    train(model, opt, 4, seed=1)  # rows updated, made and evicted (EvictUnseen(3))
    new = model.users.state_dict()
    evicted = old["ids"][~torch.isin(old["ids"], new["ids"])]
    assert evicted.numel() and not torch.equal(served_rows(server, "users", new["ids"]), new["rows"])
    assert_bitwise(served_rows(server, "users", old["ids"]), old["rows"])  # no poll yet: the old rows
    exporter.export()
    assert [(s.number, s.kind) for s in server.poll()] == [(1, "delta")]
    assert_serves(server, model)
    assert not served_rows(server, "users", evicted).any()  # an id without a row reads 0.0 in every column
    assert request(server, "/status")[1]["snapshot"]["number"] == 1
    assert request(server, "/lookup", {"table": "items", "ids": []}) == (200, {"rows": []})
    assert [re.sub(r"lag \d+\.\d{3} s$", "lag S s", line) for line in lines] == [  # one line per snapshot applied
        "EmbeddingServer: applied snapshot 0 (full of chain 0), lag S s",
        "EmbeddingServer: applied snapshot 1 (delta of chain 0), lag S s"]


def test_the_background_thread_applies_each_new_snapshot_within_a_poll(tmp_path):
    model, opt = make()
    exporter = exporter_of(model, tmp_path)
    lines: list[str] = []
    server = EmbeddingServer(tmp_path, poll_seconds=0.05, log=lines.append).start()
    try:
        for k in range(3):
            train(model, opt, 2, seed=k)
            exporter.export()
            wait_for(lambda k=k: request(server, "/status")[1].get("snapshot", {}).get("number") == k,
                     f"snapshot {k} served")
            assert_serves(server, model)
    finally:
        server.stop()
    kinds = [re.match(r"EmbeddingServer: applied snapshot (\d) \((\w+) of chain 0\), lag \d+\.\d{3} s$", line)
             for line in lines]
    assert [m.groups() if m else line for m, line in zip(kinds, lines)] == [("0", "full"), ("1", "delta"),
                                                                             ("2", "delta")]


def test_errors_are_json_naming_the_field_the_value_and_the_fix(tmp_path, serving):
    server, _ = serving
    for path, body in (("/status", None), ("/lookup", {"table": "users", "ids": [1]})):
        status, answer = request(server, path, body)
        assert status == 503 and "no snapshot is served yet" in answer["error"] and str(tmp_path) in answer["error"]
        assert "ServingExporter" in answer["error"]
    model, opt = make()
    train(model, opt, 1, seed=0)
    exporter_of(model, tmp_path).export()
    server.poll()

    def error(body: object = None, path: str = "/lookup", raw: bytes | None = None) -> tuple[int, str]:
        status, answer = request(server, path, body, raw)
        assert sorted(answer) == ["error"], answer
        return status, answer["error"]

    status, message = error(raw=b'{"table": "users", "ids": [1')
    assert status == 400 and "the body is not JSON" in message and "fix: send" in message
    status, message = error(raw=b"\xff\xfe")
    assert status == 400 and "not JSON" in message
    status, message = error([1, 2])
    assert status == 400 and "must be a JSON object" in message and "[1, 2]" in message
    status, message = error({"ids": [1]})
    assert status == 400 and "field 'table' is missing" in message and "['items', 'users']" in message
    status, message = error({"table": "movies", "ids": [1]})
    assert status == 400 and "field 'table' is 'movies'" in message and "fix: name one of ['items', 'users']" in message
    status, message = error({"table": "users"})
    assert status == 400 and "field 'ids' is missing" in message
    status, message = error({"table": "users", "ids": 7})
    assert status == 400 and "field 'ids' must be a list" in message and "got 7" in message
    for bad, shown in ((1.5, "1.5"), ("3", "'3'"), (True, "True"), (2**63, str(2**63)), (None, "None")):
        status, message = error({"table": "users", "ids": [4, bad]})
        assert status == 400 and f"ids[1] is {shown}, not an int64 id" in message, message
    assert request(server, "/lookup", {"table": "users", "ids": [-(2**63), 2**63 - 1]})[0] == 200
    status, message = error(path="/rows")
    assert status == 404 and "no GET '/rows' here; fix: GET /status or POST /lookup" in message
    status, message = error({"table": "users", "ids": [1]}, path="/status")
    assert status == 404 and "no POST '/status'" in message


def test_a_failed_poll_is_logged_once_and_the_last_good_snapshot_stays_served(tmp_path, serving):
    server, lines = serving
    model, opt = make()
    exporter = exporter_of(model, tmp_path)
    train(model, opt, 2, seed=0)
    exporter.export()
    server.poll()
    good = {name: getattr(model, name).state_dict() for name in ("users", "items")}
    train(model, opt, 3, seed=1)
    damaged = exporter.export()
    rows = damaged / "embeddings" / "items" / "rows.bin"
    rows.write_bytes(rows.read_bytes()[:-3])
    assert server.poll() == [] and server.poll() == []
    failures = [line for line in lines if "failed" in line]
    assert len(failures) == 1, lines  # the same failure, once (the background thread's first poll may be it)
    assert failures[0].startswith(f"EmbeddingServer: poll of {str(tmp_path)!r} failed (still serving snapshot 0): "
                                   "ValueError: ") and "damaged" in failures[0]
    for name, state in good.items():
        assert_bitwise(served_rows(server, name, state["ids"]), state["rows"])
    status, answer = request(server, "/status")
    assert status == 200 and answer["snapshot"]["number"] == 0 and "damaged" in answer["poll_error"]
    exporter.export(full=True)  # the cure: a new chain
    assert [(s.number, s.kind) for s in server.poll()] == [(2, "full")]
    assert_serves(server, model)
    assert request(server, "/status")[1]["poll_error"] is None


def test_a_failed_first_poll_is_in_the_503_answer(tmp_path, serving):
    server, lines = serving
    (tmp_path / "000000").mkdir()  # a numbered directory without snapshot.json
    server.poll()
    assert "failed (no snapshot served yet)" in lines[-1]
    status, answer = request(server, "/status")
    assert status == 503 and "the last poll failed: ValueError" in answer["error"]


def test_stop_joins_every_thread_and_closes_the_socket(tmp_path):
    before = set(threading.enumerate())
    server = EmbeddingServer(tmp_path, poll_seconds=0.05, log=lambda line: None).start()
    assert {t.name for t in set(threading.enumerate()) - before} >= {"unison-serve-embeddings-http",
                                                                      "unison-serve-embeddings-poll"}
    assert request(server, "/status")[0] == 503
    server.stop()
    assert set(threading.enumerate()) - before == set()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(server.url + "/status", timeout=5)
    server.stop()  # twice: nothing more to do
    with pytest.raises(RuntimeError, match="make a new one"):
        server.start()
    EmbeddingServer(tmp_path).stop()  # never started: closes its socket


def test_bad_arguments_name_the_value_and_the_fix(tmp_path):
    for bad in (0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match=rf"`poll_seconds` must be a positive, finite number of seconds, got "
                                             rf"{bad!r}; fix"):
            EmbeddingServer(tmp_path, poll_seconds=bad)
    for bad in (True, "1", None):
        with pytest.raises(TypeError, match=rf"`poll_seconds` must be a number of seconds, got {bad!r}; fix"):
            EmbeddingServer(tmp_path, poll_seconds=bad)


def test_lookup_gives_stored_rows_unpooled_whatever_the_mode():
    table = ServingEmbedding(2, torch.float32, "sum", 0.5, "chain", 0)
    table._upsert(torch.tensor([7, 9]), torch.tensor([[-0.0, 1.0], [2.0, 3.0]]))
    rows = table.lookup(torch.tensor([9, 7, 8]))
    assert_bitwise(rows, torch.tensor([[2.0, 3.0], [-0.0, 1.0], [0.5, 0.5]]))
    assert table.lookup(torch.tensor([[7], [9]])).shape == (2, 1, 2)
    with pytest.raises(TypeError, match="int64 tensor"):
        table.lookup(torch.tensor([7.0]))


def test_the_command_refuses_a_path_that_is_not_a_directory(tmp_path, capsys):
    assert cli.main(["serve-embeddings", str(tmp_path / "missing")]) == 2
    assert f"PATH {str(tmp_path / 'missing')!r} does not exist; fix:" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    assert cli.main(["serve-embeddings", str(tmp_path / "file")]) == 2
    assert f"PATH {str(tmp_path / 'file')!r} is not a directory; fix:" in capsys.readouterr().err
    for flags in (["--poll-seconds", "0"], ["--port", "70000"]):
        with pytest.raises(SystemExit) as exit_:
            cli.main(["serve-embeddings", str(tmp_path), *flags])
        assert exit_.value.code == 2


def test_the_command_serves_until_sigterm_exits_0_and_imports_no_training_code(tmp_path):
    model, opt = make()
    train(model, opt, 1, seed=0)
    exporter_of(model, tmp_path).export()
    code = ("import sys\nfrom unison._launch.cli import main\n"
            f"code = main(['serve-embeddings', {str(tmp_path)!r}, '--poll-seconds', '0.2'])\n"
            "training = sorted(m for m in sys.modules if m.startswith(('unison._strategies', 'unison._ps', "
            "'unison._embeddings.modules', 'unison._gradient_sync')))\n"
            "print('training modules:', training)\n"
            # the tables' forward runs eagerly under torch.compile without importing Dynamo (2-3 s) to say so
            "print('dynamo loaded:', 'torch._dynamo' in sys.modules)\nsys.exit(code)\n")
    paths = [str(Path(unison.__file__).parents[1]), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path for path in paths if path)}  # this tree's unison
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=env)
    try:
        seen = ""
        while "unison serve-embeddings:" not in seen:  # blocks until it listens (warnings may come first)
            line = process.stderr.readline()
            assert line, seen + process.stderr.read()  # it ended first
            seen += line
        match = re.search(rf"^unison serve-embeddings: serving {re.escape(str(tmp_path))} at "
                          rf"(http://127\.0\.0\.1:\d+)$", seen, re.MULTILINE)
        assert match, seen
        status: dict = {}

        def served() -> bool:  # 503 until its first poll has loaded the snapshot
            try:
                with urllib.request.urlopen(match.group(1) + "/status", timeout=20) as answer:
                    status.update(json.loads(answer.read()))
            except urllib.error.HTTPError as error:
                assert error.code == 503, error
                error.close()
            return bool(status)

        wait_for(served, "snapshot served by the command")
        assert status["tables"]["users"]["rows"] == model.users.state_dict()["ids"].numel()
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, err
    assert "EmbeddingServer: applied snapshot 0 (full of chain 0)" in out and "training modules: []" in out, out
    assert "dynamo loaded: False" in out, out
