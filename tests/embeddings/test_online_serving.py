"""Online serving: ServingExporter publishes numbered snapshots (tables and dense state) of a model in training,
and ServingFollower brings a served model to the newest one on each poll.

Rows are compared bit for bit with the training table's at the snapshot polled; one device (the export of
a table on ps tasks is tested in ``tests/ps/test_delta_checkpoints_on_ps.py``, and the online example runs
the exporter under the hybrid strategy in ``tests/examples/test_online_ctr_example.py``)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from torch import nn

from tests.embeddings._ranker import Ranker, make, train
from unison.embeddings import ServingExporter, ServingFollower

pytestmark = pytest.mark.timeout(120)


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def exporter_of(model: Ranker, root, **kwargs) -> ServingExporter:
    return ServingExporter(root, {"users": model.users, "items": model.items}, dense=model,
                           every_seconds=kwargs.pop("every_seconds", 5.0), **kwargs)


def assert_serves(follower: ServingFollower, model: Ranker) -> None:
    """The served tables hold the training tables' rows exactly, and the dense state is the model's."""
    for name in ("users", "items"):
        state = getattr(model, name).state_dict()
        served = follower.embeddings[name]
        assert served.num_rows == state["ids"].numel()
        assert torch.equal(served._rows_of(state["ids"]), state["rows"]), name
    assert follower.dense_state is not None and sorted(follower.dense_state) == ["head.bias", "head.weight"]
    for key, value in follower.dense_state.items():
        assert torch.equal(value, model.state_dict()[key]) and type(value) is torch.Tensor


def test_after_an_explicit_poll_the_served_model_equals_the_trained_one_at_that_snapshot(tmp_path):
    model, opt = make()
    clock = Clock()
    exporter = exporter_of(model, tmp_path, clock=clock)
    follower = ServingFollower(tmp_path)
    assert follower.poll() == [] and follower.number is None and dict(follower.embeddings) == {}

    train(model, opt, 3, seed=0)
    assert exporter.maybe_export() is None  # 0 s of 5 passed
    clock.now = 5.0
    first = exporter.maybe_export(info={"step": 3})
    assert first is not None and first.name == "000000"
    assert exporter.flush() == first  # written on the exporter's thread: published now
    meta = json.loads((first / "snapshot.json").read_text())
    assert meta["kind"] == "full" and meta["chain"] == 0 and meta["base"] is None and meta["info"] == {"step": 3}
    assert sorted(p.name for p in first.iterdir()) == ["dense.pt", "embeddings", "snapshot.json"]
    [applied] = follower.poll()
    assert (applied.number, applied.kind, applied.info) == (0, "full", {"step": 3})
    assert applied.lag >= 0 and applied.worst_lag is None  # nothing before the first snapshot
    assert_serves(follower, model)

    served = Ranker()  # the serving process's model: the served tables in place of the trained ones
    served.users, served.items = follower.embeddings["users"], follower.embeddings["items"]
    served.load_state_dict(follower.dense_state)
    users, items = model.users.state_dict()["ids"][:6].reshape(3, 2), model.items.state_dict()["ids"][:3]
    with torch.no_grad():
        assert torch.equal(served(users, items), model.eval()(users, items))
    model.train()

    for k in (1, 2):  # two deltas, each while rows change, come and go
        train(model, opt, 4, seed=k)
        clock.now += 5.0
        assert exporter.maybe_export() is not None
    exporter.flush()
    served_users = follower.embeddings["users"]
    applied = follower.poll()
    assert [(s.number, s.kind, s.chain) for s in applied] == [(1, "delta", 0), (2, "delta", 0)]
    assert follower.embeddings["users"] is served_users  # deltas apply in place
    assert applied[1].worst_lag is not None and applied[1].worst_lag >= applied[1].lag >= 0
    assert follower.number == 2 and follower.last == applied[-1]
    assert_serves(follower, model)
    assert follower.poll() == []


def test_full_every_starts_new_chains_a_late_follower_loads_the_newest_and_old_chains_are_pruned(tmp_path):
    model, opt = make()
    exporter = exporter_of(model, tmp_path, full_every=1, keep_chains=2)
    early = ServingFollower(tmp_path)
    kinds = []
    for k in range(5):
        train(model, opt, 2, seed=k)
        kinds.append(json.loads((exporter.export() / "snapshot.json").read_text())["kind"])
        if k == 1:
            assert [s.number for s in early.poll()] == [0, 1]
    assert kinds == ["full", "delta", "full", "delta", "full"]
    # chains start at 0, 2 and 4: the newest two are kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["000002", "000003", "000004"]
    assert [(s.number, s.kind) for s in early.poll()] == [(4, "full")]  # its chain is gone: it loads the newest
    assert_serves(early, model)
    late = ServingFollower(tmp_path)
    train(model, opt, 2, seed=9)
    exporter.export()
    assert [(s.number, s.kind, s.chain) for s in late.poll()] == [(4, "full", 4), (5, "delta", 4)]
    assert_serves(late, model)
    early.poll()
    assert_serves(early, model)


def test_a_restarted_exporter_continues_the_numbers_with_a_full_snapshot(tmp_path):
    model, opt = make()
    exporter_of(model, tmp_path).export()
    train(model, opt, 2, seed=0)
    follower = ServingFollower(tmp_path)
    follower.poll()
    again = exporter_of(model, tmp_path, keep_chains=None)  # a new job on the same root
    assert again.next_number == 1
    again.export()
    assert [(s.number, s.kind) for s in follower.poll()] == [(1, "full")]
    assert_serves(follower, model)


def test_a_partial_or_damaged_snapshot_changes_nothing(tmp_path):
    model, opt = make()
    exporter = exporter_of(model, tmp_path)
    exporter.export()
    follower = ServingFollower(tmp_path)
    follower.poll()
    (tmp_path / ".000001.123.abcd.tmp" / "embeddings").mkdir(parents=True)  # one being written: not listed
    assert follower.poll() == []
    before = {name: table._rows_of(torch.arange(-10, 10_000)).clone() for name, table in follower.embeddings.items()}

    def unchanged() -> None:
        assert follower.number == 0
        for name, rows in before.items():
            assert torch.equal(follower.embeddings[name]._rows_of(torch.arange(-10, 10_000)), rows)

    train(model, opt, 3, seed=1)
    good = exporter.export()
    train(model, opt, 3, seed=2)
    damaged = exporter.export()
    rows = damaged / "embeddings" / "items" / "rows.bin"
    rows.write_bytes(rows.read_bytes()[:-3])
    with pytest.raises(ValueError, match="damaged"):
        follower.poll()  # snapshot 1 is whole, 2 is not: neither is applied
    unchanged()
    shutil.rmtree(damaged)
    (damaged / "embeddings").mkdir(parents=True)  # a numbered directory without snapshot.json
    with pytest.raises(ValueError, match="has no snapshot.json: it is damaged"):
        follower.poll()
    unchanged()
    shutil.rmtree(damaged)
    shutil.rmtree(good)  # a gap: 1 is gone, and 2 follows it
    exporter._next = 2  # (this exporter wrote the 2 removed above: it writes 2 again, after 1)
    train(model, opt, 1, seed=3)
    exporter.export()
    with pytest.raises(ValueError, match="snapshot 2 is a delta of chain 0 after snapshot 1, but the follower's next "
                                         "step is after snapshot 0 .* a snapshot between is missing"):
        follower.poll()
    unchanged()
    exporter.export(full=True)  # the cure: a full snapshot
    assert [s.number for s in follower.poll()] == [3]
    assert_serves(follower, model)


def test_bad_arguments_name_the_field_the_value_and_the_fix(tmp_path):
    model, _ = make()
    tables = {"users": model.users, "items": model.items}
    with pytest.raises(ValueError, match="`embeddings` must be a non-empty dict"):
        ServingExporter(tmp_path, {}, every_seconds=1)
    with pytest.raises(TypeError, match=r"`embeddings\['head'\]` must be a unison.DynamicEmbedding, got Linear"):
        ServingExporter(tmp_path, {"head": model.head}, every_seconds=1)
    with pytest.raises(ValueError, match="table name '../x' must be"):
        ServingExporter(tmp_path, {"../x": model.users}, every_seconds=1)
    for bad in (0, -1.0, True, "5"):
        with pytest.raises(ValueError, match=f"`every_seconds` must be a number > 0, got {bad!r}"):
            ServingExporter(tmp_path, tables, every_seconds=bad)
    with pytest.raises(ValueError, match="`full_every` must be an int >= 0 .* got -1"):
        ServingExporter(tmp_path, tables, every_seconds=1, full_every=-1)
    with pytest.raises(ValueError, match="`keep_chains` must be an int >= 1 .* got 0"):
        ServingExporter(tmp_path, tables, every_seconds=1, keep_chains=0)
    with pytest.raises(TypeError, match="`dense` must be an nn.Module"):
        ServingExporter(tmp_path, tables, every_seconds=1, dense=model.state_dict())
    with pytest.raises(ValueError, match="holds a DynamicEmbedding at 'items' that is not in `embeddings`.*"
                                         r"fix: add it, e.g. embeddings=\{'items': model.items\}"):
        ServingExporter(tmp_path, {"users": model.users}, every_seconds=1, dense=model)
    exporter = ServingExporter(tmp_path, tables, every_seconds=1)
    with pytest.raises(ValueError, match="a delta cannot be forced"):
        exporter.export(full=False)
    with pytest.raises(TypeError, match="`info` must be a dict"):
        exporter.export(info=[1])
    assert list(tmp_path.iterdir()) == []  # nothing written by a refused call
    with pytest.raises(TypeError, match="`default` must be a number"):
        ServingFollower(tmp_path, default="0")


def test_the_dense_state_leaves_the_tables_out_without_reading_them(tmp_path, monkeypatch):
    """A table's state_dict reads every row (from the ps tasks, there): the exporter never asks for it, and
    the dense state is the model's state_dict less the tables' entries, buffers and nested modules included."""
    model, opt = make()
    model.norm = nn.BatchNorm1d(8)  # persistent buffers, in a subtree without a table
    outer = nn.ModuleDict({"ranker": model, "calibration": nn.Linear(1, 1)})
    outer.register_buffer("scale", torch.tensor(2.0))
    outer.register_buffer("scratch", torch.zeros(3), persistent=False)
    train(model, opt, 2, seed=0)
    exporter = ServingExporter(tmp_path, {"users": model.users, "items": model.items}, dense=outer, every_seconds=1)
    want = {k: v for k, v in outer.state_dict().items() if ".users." not in k and ".items." not in k}
    for table in (model.users, model.items):
        def refuse(*args, **kwargs):
            raise AssertionError("the exporter read a table's state_dict")
        monkeypatch.setattr(table, "_save_to_state_dict", refuse)
    exporter.export()
    follower = ServingFollower(tmp_path)
    follower.poll()
    assert follower.dense_state is not None and sorted(follower.dense_state) == sorted(want)
    assert "ranker.norm.running_mean" in want and "scale" in want and "scratch" not in want
    for key, value in want.items():
        assert torch.equal(follower.dense_state[key], value), key


def test_maybe_export_writes_on_its_own_thread_while_training_goes_on(tmp_path, monkeypatch):
    """The step waits for the rows to be taken, not for the files: the snapshot holds the model as it was
    then, though training changed it before the files were written."""
    import threading

    import unison._embeddings.serving.exporter as exporter_module

    release, writing = threading.Event(), threading.Event()
    write_export = exporter_module.write_export

    def slow_write(*args, **kwargs):
        writing.set()
        assert release.wait(30)
        return write_export(*args, **kwargs)

    model, opt = make()
    clock = Clock()
    exporter = exporter_of(model, tmp_path, clock=clock)
    train(model, opt, 3, seed=0)
    then = {name: getattr(model, name).state_dict() for name in ("users", "items")}
    head = {key: value.clone() for key, value in model.head.state_dict().items()}
    monkeypatch.setattr(exporter_module, "write_export", slow_write)
    clock.now = 5.0
    path = exporter.maybe_export()
    assert path is not None and writing.wait(30) and not path.exists()  # returned while the files are written
    train(model, opt, 2, seed=1)  # training goes on meanwhile
    release.set()
    assert exporter.flush() == path and path.exists()
    follower = ServingFollower(tmp_path)
    follower.poll()
    for name, state in then.items():
        assert torch.equal(follower.embeddings[name]._rows_of(state["ids"]), state["rows"]), name
    assert all(torch.equal(follower.dense_state[f"head.{key}"], value) for key, value in head.items())


def test_a_failed_background_write_is_raised_by_the_next_call_and_the_next_snapshot_is_full(tmp_path, monkeypatch):
    import unison._embeddings.serving.exporter as exporter_module

    write_export = exporter_module.write_export
    model, opt = make()
    clock = Clock()
    exporter = exporter_of(model, tmp_path, clock=clock)
    exporter.export()  # full 0
    train(model, opt, 2, seed=0)

    def failing(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(exporter_module, "write_export", failing)
    clock.now = 5.0
    lost = exporter.maybe_export()
    assert lost is not None
    with pytest.raises(RuntimeError, match=r"writing a snapshot under .* failed: .*No space left on device.*next "
                                           r"snapshot is full; fix: the cause"):
        exporter.flush()
    assert not lost.exists() and not list(tmp_path.glob(".*tmp*"))  # nothing half-written is left
    monkeypatch.setattr(exporter_module, "write_export", write_export)
    clock.now = 10.0
    path = exporter.maybe_export()
    exporter.flush()
    assert json.loads((path / "snapshot.json").read_text())["kind"] == "full"
    follower = ServingFollower(tmp_path)
    follower.poll()
    assert_serves(follower, model)


def test_export_raises_a_failed_write_as_it_was_and_publishes_nothing(tmp_path, monkeypatch):
    import unison._embeddings.serving.exporter as exporter_module

    write_export = exporter_module.write_export

    def failing(*args, **kwargs):
        raise OSError(28, "No space left on device")

    model, _ = make()
    exporter = exporter_of(model, tmp_path)
    monkeypatch.setattr(exporter_module, "write_export", failing)
    with pytest.raises(OSError, match="No space left on device"):
        exporter.export()  # written by this call: its error as it was
    assert exporter.flush() is None and exporter.last is None and not list(tmp_path.iterdir())
    monkeypatch.setattr(exporter_module, "write_export", write_export)
    path = exporter.export()
    assert json.loads((path / "snapshot.json").read_text())["kind"] == "full"


def test_a_failed_prune_warns_and_keeps_the_new_snapshot(tmp_path, monkeypatch):
    from unison._embeddings.serving import snapshots

    model, _ = make()
    exporter = exporter_of(model, tmp_path, full_every=0, keep_chains=1)  # every snapshot full, keep one
    exporter.export()

    def refused(root, number):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(snapshots, "remove", refused)
    with pytest.warns(RuntimeWarning, match=r"removing the chains before snapshot 1 under .* failed .*Permission "
                                            r"denied.*they stay on disk"):
        path = exporter.export()
    assert exporter.last == path and path.exists() and (tmp_path / "000000").exists()
    monkeypatch.undo()
    exporter.export()  # the next full snapshot prunes both
    assert sorted(p.name for p in tmp_path.iterdir()) == ["000002"]
