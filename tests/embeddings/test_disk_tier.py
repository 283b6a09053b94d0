"""The disk tier on one device: a table with a quarter of its rows in memory trains, evicts, admits and
checkpoints exactly as the in-memory table; eviction deletes from disk; bad settings name the fix."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

pytest.importorskip("lmdb", reason="the disk tier needs lmdb: pip install 'unison[disk]' (make install does)")

import unison  # noqa: E402
from unison import DynamicEmbedding  # noqa: E402
from unison.embeddings import AdmitAfter, DiskStorage, EvictUnseen  # noqa: E402

DIM = 8
IDS = 400


def _budget_for(rows: int, state_columns: int, total: int = IDS) -> int:
    """Bytes of ``rows`` hot rows with ``state_columns`` of state, and of the in-memory index of the
    other ``total - rows`` (as the tier counts them)."""
    slot = 4 * (DIM + state_columns) + 8 + 1 + 8 + 8
    return rows * (slot + 32) + (total - rows) * 75


def _assert_within_budget(emb: DynamicEmbedding, budget: int, step_rows: int = 0) -> None:
    """The hot rows and the cold rows' index take at most the budget (and one step's rows over it)."""
    table = emb.table
    per_row = table._hot.slot_bytes + 32
    assert 0 < table.hot_rows < emb.num_rows
    assert table.hot_rows * per_row + table._cold.nbytes <= budget + step_rows * per_row


def _batches(count: int, seed: int = 0, ids: int = IDS, batch: int = 32):
    g = torch.Generator().manual_seed(seed)
    skew = torch.linspace(3.0, 0.2, ids)  # some ids hot, most cold
    return [torch.multinomial(skew, batch * 2, replacement=True, generator=g).reshape(batch, 2) * 7919 - 2**40
            for _ in range(count)]


def _train(emb: DynamicEmbedding, optimizer: type, batches, **opt_args) -> DynamicEmbedding:
    opt = optimizer(emb.parameters(), **opt_args)
    for ids in batches:
        opt.zero_grad()
        emb(ids).pow(2).sum().mul(0.01).backward()
        opt.step()
    return emb


_CHAIN = ("table_id", "sequence", "exact", "disk")  # a delta chain's place and the disk store's, not the rows


def _assert_same(ours: dict, theirs: dict) -> None:
    assert sorted(ours) == sorted(theirs)
    for key, value in theirs.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(ours[key], value), key
        elif key.endswith("_extra_state"):
            assert ({k: v for k, v in ours[key].items() if k not in _CHAIN}
                    == {k: v for k, v in value.items() if k not in _CHAIN}), key
        else:
            assert ours[key] == value, key


OPTIMIZERS = [(torch.optim.Adagrad, {"lr": 0.2}, DIM), (torch.optim.SparseAdam, {"lr": 0.05}, 2 * DIM),
              (torch.optim.SGD, {"lr": 0.5}, 0)]


@pytest.mark.filterwarnings("ignore:DiskStorage. .* rows in memory after spilling:RuntimeWarning")  # 64 ids a step
@pytest.mark.parametrize(("optimizer", "args", "state"), OPTIMIZERS, ids=["adagrad", "sparse_adam", "sgd"])
@pytest.mark.parametrize("cache", ["lru", "lfu"])
def test_a_quarter_of_the_rows_in_memory_trains_exactly_as_the_in_memory_table(tmp_path, optimizer, args, state,
                                                                                cache):
    batches = _batches(25)
    reference = _train(DynamicEmbedding(DIM, mode="sum", seed=3), optimizer, batches, **args)
    budget = _budget_for(IDS // 4, state)
    storage = DiskStorage(tmp_path / "rows", memory_budget_bytes=budget, cache=cache)
    ours = _train(DynamicEmbedding(DIM, mode="sum", seed=3, storage=storage), optimizer, batches, **args)
    table = ours.table
    assert ours.num_rows == reference.num_rows > 300
    _assert_within_budget(ours, budget, step_rows=64)  # the budget, or one step's rows over it
    if state:  # a row with state takes more than the cold rows' index: about a quarter of the rows stay
        assert table.hot_rows <= IDS // 4 + 64
    assert table.disk_bytes > 0
    _assert_same(ours.state_dict(), reference.state_dict())
    # evaluation reads cold rows from disk and leaves them there
    probe = torch.cat([b.reshape(-1) for b in batches])[:200].reshape(100, 2)
    hot = table.hot_rows
    with torch.no_grad():
        assert torch.equal(ours.eval()(probe), reference.eval()(probe))
    assert table.hot_rows == hot


def test_policies_choose_over_both_tiers_as_in_memory(tmp_path):
    """A capacity, a time to live in steps and admission see every row, hot or cold."""
    batches = _batches(30, seed=1)

    def table(storage=None):
        return DynamicEmbedding(DIM, mode="sum", seed=5, capacity=250, eviction=EvictUnseen(12),
                                admission=AdmitAfter(2, sketch_width=4096, sketch_depth=4), storage=storage)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a step over the budget, by design of the small budget
        reference = _train(table(), torch.optim.Adagrad, batches, lr=0.2)
        storage = DiskStorage(tmp_path, memory_budget_bytes=_budget_for(60, DIM, total=250))
        ours = _train(table(storage), torch.optim.Adagrad, batches, lr=0.2)
    assert 0 < ours.num_rows == reference.num_rows <= 250
    assert ours.table.hot_rows < ours.num_rows
    _assert_same(ours.state_dict(), reference.state_dict())


@pytest.mark.filterwarnings("ignore:DiskStorage. .* rows in memory after spilling:RuntimeWarning")
def test_eviction_deletes_rows_from_disk(tmp_path):
    early = torch.arange(0, 200).reshape(100, 2)
    late = [torch.arange(1000 + 20 * i, 1020 + 20 * i).reshape(10, 2) for i in range(8)]
    storage = DiskStorage(tmp_path, memory_budget_bytes=_budget_for(50, DIM, total=220))
    emb = DynamicEmbedding(DIM, mode="sum", eviction=EvictUnseen(3), storage=storage)
    reference = DynamicEmbedding(DIM, mode="sum", eviction=EvictUnseen(3))
    opts = [torch.optim.Adagrad(e.parameters(), lr=0.1) for e in (emb, reference)]
    cold = emb.table._cold
    for step, ids in enumerate([early, *late]):
        if step == 2:
            assert cold.num_rows >= 50 and len(cold._store) == cold.num_rows + cold.shadow_rows  # spilled
        for e, opt in zip((emb, reference), opts):
            opt.zero_grad()
            e(ids).sum().backward()
            opt.step()
    assert emb.num_rows == reference.num_rows < 100  # the early rows went, unseen for 3 steps
    _assert_same(emb.state_dict(), reference.state_dict())
    assert bool((cold._index.find(early.reshape(-1)) < 0).all())  # neither cold nor a shadow copy
    assert len(cold._store) == cold.num_rows + cold.shadow_rows  # deleted on disk too, not only forgotten


@pytest.mark.filterwarnings("ignore:DiskStorage. .* rows in memory after spilling:RuntimeWarning")  # 64 ids a step
def test_a_checkpoint_round_trips_with_spilled_rows_and_loads_beyond_the_budget_to_disk(tmp_path):
    batches, more = _batches(20, seed=2), _batches(10, seed=3)
    budget = _budget_for(IDS // 4, DIM)
    ours = _train(DynamicEmbedding(DIM, mode="sum", storage=DiskStorage(tmp_path / "a", budget)),
                  torch.optim.Adagrad, batches, lr=0.2)
    saved = ours.state_dict()
    assert ours.table.hot_rows < ours.num_rows
    # onto a table with storage (the rows beyond its budget written to disk as they load) and one without
    loaded = DynamicEmbedding(DIM, mode="sum", storage=DiskStorage(tmp_path / "b", budget))
    loaded.load_state_dict(saved)
    plain = DynamicEmbedding(DIM, mode="sum")
    plain.load_state_dict(saved)
    assert loaded.num_rows == ours.num_rows
    _assert_within_budget(loaded, budget)
    _assert_same(loaded.state_dict(), saved)
    _assert_same(plain.state_dict(), saved)
    # and the three go on training alike
    for emb in (ours, loaded, plain):
        _train(emb, torch.optim.Adagrad, more, lr=0.2)
    _assert_same(loaded.state_dict(), plain.state_dict())
    _assert_same(ours.state_dict(), plain.state_dict())
    # loading into the same table again replaces its files: the checkpoint is the truth
    first = loaded.table._cold._store.directory
    loaded.load_state_dict(saved)
    assert not first.exists() and len(list((tmp_path / "b" / "local").iterdir())) == 1
    _assert_same(loaded.state_dict(), saved)


@pytest.mark.filterwarnings("ignore:DiskStorage. .* rows in memory after spilling:RuntimeWarning")
def test_a_new_table_on_the_same_path_discards_what_an_earlier_run_left_at_its_first_spill(tmp_path):
    storage = DiskStorage(tmp_path, memory_budget_bytes=_budget_for(20, DIM, total=100))
    first = _train(DynamicEmbedding(DIM, mode="sum", storage=storage), torch.optim.Adagrad, _batches(5), lr=0.1)
    left = first.table._cold._store.directory
    _crash(first)
    second = DynamicEmbedding(DIM, mode="sum", storage=storage)  # a restarted process: starts empty
    assert second.num_rows == 0 and left.exists()  # kept until it writes: a checkpoint may resume from it
    _train(second, torch.optim.Adagrad, _batches(5), lr=0.1)
    assert not left.exists() and len(list((tmp_path / "local").iterdir())) == 1


def _crash(emb: DynamicEmbedding) -> None:
    """What a killed process leaves: its store's files as they are (closed, not removed)."""
    emb.table._cold.close(remove=False)


def _rows_written(monkeypatch) -> list[int]:
    """Counts the rows every store of this process writes from now on."""
    from unison._embeddings.tables.disk.storage import KeyValueStore

    written, put = [0], KeyValueStore.put

    def counting(self, keys, values, mark):
        written[0] += keys.numel()
        put(self, keys, values, mark)

    monkeypatch.setattr(KeyValueStore, "put", counting)
    return written


@pytest.mark.filterwarnings("ignore:DiskStorage. .* rows in memory after spilling:RuntimeWarning")
@pytest.mark.parametrize(("optimizer", "args", "state"), OPTIMIZERS[:2], ids=["adagrad", "sparse_adam"])
def test_a_rebuilt_table_resumes_from_its_files_and_the_checkpoint_rolling_back_later_writes(
        tmp_path, monkeypatch, optimizer, args, state):
    """A table rebuilt on the same path (a restarted process) loads its checkpoint keeping the cold rows on
    disk that did not change since it: rows touched after the checkpoint (on disk or not) read the
    checkpoint's values, rows made after it are gone, and training goes on as the uninterrupted run."""
    before, after, more = _batches(15, seed=4), _batches(6, seed=5), _batches(8, seed=6)
    budget = _budget_for(IDS // 4, state)
    ours = _train(DynamicEmbedding(DIM, mode="sum", seed=2, storage=DiskStorage(tmp_path, budget)), optimizer,
                  before, **args)
    saved = ours.state_dict()
    cold_at_save = ours.table._cold.num_rows
    reference = _train(DynamicEmbedding(DIM, mode="sum", seed=2), optimizer, before, **args)
    touched = torch.unique(torch.cat([b.reshape(-1) for b in after]))
    _train(ours, optimizer, after + [b + 1 for b in after], **args)  # rows change on disk; new ids (b + 1) come
    with torch.no_grad():
        moved = ours.table.lookup(touched, create=False)
    assert not torch.equal(moved, reference.table.lookup(touched, create=False))
    store = ours.table._cold._store.directory
    _crash(ours)

    written = _rows_written(monkeypatch)
    resumed = DynamicEmbedding(DIM, mode="sum", seed=2, storage=DiskStorage(tmp_path, budget))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # resumed, no fallback
        resumed.load_state_dict(saved)
    assert resumed.table._cold._store.directory == store  # the same files, not a new store
    assert written[0] < cold_at_save // 2  # the save's hot rows and the rolled back ones, not every cold row
    assert resumed.table._cold.num_rows > 0
    assert len(resumed.table._cold._store) == resumed.table._cold.num_rows  # no shadow or later row left behind
    _assert_same(resumed.state_dict(), saved)  # later writes rolled back, later rows gone
    with torch.no_grad():
        assert torch.equal(resumed.table.lookup(touched, create=False), reference.table.lookup(touched, create=False))
    _assert_same(_train(resumed, optimizer, more, **args).state_dict(),
                 _train(reference, optimizer, more, **args).state_dict())


def _trained_on_disk(path, budget: int) -> DynamicEmbedding:
    """A table with a disk tier under ``path`` after ten steps of Adagrad."""
    return _train(DynamicEmbedding(DIM, mode="sum", storage=DiskStorage(path, budget)), torch.optim.Adagrad,
                  _batches(10, seed=7), lr=0.2)


@pytest.mark.filterwarnings("ignore:DiskStorage. .* rows in memory after spilling:RuntimeWarning")
def test_a_checkpoint_older_than_the_files_loads_every_row_and_says_why(tmp_path):
    """The files were sealed again by a later full save: they cannot be proven to hold the older one."""
    budget = _budget_for(IDS // 4, DIM)
    ours = _trained_on_disk(tmp_path, budget)
    older = ours.state_dict()
    _train(ours, torch.optim.Adagrad, _batches(3, seed=8), lr=0.2)
    ours.state_dict()  # a later full save: a new seal
    _crash(ours)
    rebuilt = DynamicEmbedding(DIM, mode="sum", storage=DiskStorage(tmp_path, budget))
    with pytest.warns(RuntimeWarning, match=r"DiskStorage: not resuming from the files of the checkpoint's store "
                                            r"under '.*local': store '.*rows-\w+' is at seal 2, the checkpoint at "
                                            r"seal 1; every row of this place is loaded from the checkpoint"):
        rebuilt.load_state_dict(older)
    _assert_same(rebuilt.state_dict(), older)
    assert len(list((tmp_path / "local").iterdir())) == 1  # the files it could not use are gone


@pytest.mark.filterwarnings("ignore:DiskStorage. .* rows in memory after spilling:RuntimeWarning")
def test_files_of_another_store_format_are_not_resumed_from_and_every_row_loads(tmp_path):
    """A store whose rows are laid out another way (an older unison's) is never read as this one's."""
    import lmdb

    budget = _budget_for(IDS // 4, DIM)
    ours = _trained_on_disk(tmp_path, budget)
    saved = ours.state_dict()
    store = ours.table._cold._store.directory
    _crash(ours)
    env = lmdb.open(str(store), max_dbs=3, map_size=1 << 30)
    with env.begin(write=True) as txn:
        txn.delete(b"format", db=env.open_db(b"meta", txn=txn))  # as a store of format 1 recorded none
    env.close()
    rebuilt = DynamicEmbedding(DIM, mode="sum", storage=DiskStorage(tmp_path, budget))
    with pytest.warns(RuntimeWarning, match=r"not resuming from the files of the checkpoint's store under "
                                            r"'.*local': store '.*rows-\w+' has its rows in format 1, this version "
                                            r"of unison reads format 2; every row of this place is loaded"):
        rebuilt.load_state_dict(saved)
    _assert_same(rebuilt.state_dict(), saved)
    assert rebuilt.table._cold._store.directory != store


def test_bad_storage_settings_name_the_field_the_value_and_the_fix(tmp_path):
    with pytest.raises(ValueError, match=r"`storage.memory_budget_bytes` is 100, less than one row of 64 "
                                         r"torch.float32 values .*fix: DiskStorage\(\.\.\., "
                                         r"memory_budget_bytes=\.\.\.\) of at least"):
        DynamicEmbedding(64, storage=DiskStorage(tmp_path, memory_budget_bytes=100))
    with pytest.raises(ValueError, match=r"`memory_budget_bytes` must be an int >= 1 .* got 0; fix"):
        DiskStorage(tmp_path, memory_budget_bytes=0)
    with pytest.raises(ValueError, match=r"`cache` must be one of \('lru', 'lfu'\).*got 'fifo'; fix: cache='lru'"):
        DiskStorage(tmp_path, memory_budget_bytes=1 << 20, cache="fifo")
    with pytest.raises(TypeError, match=r"`path` must be a directory path"):
        DiskStorage(None, memory_budget_bytes=1 << 20)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"`storage` must be None \(rows in memory\) or a "
                                        r"unison.embeddings.DiskStorage"):
        DynamicEmbedding(4, storage=str(tmp_path))  # type: ignore[arg-type]
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=r"cannot keep rows under `path` '.*a_file/local'.*fix: a directory on "
                                         r"local disk that this process may write"):
        DynamicEmbedding(4, storage=DiskStorage(blocker, memory_budget_bytes=1 << 20))


def test_a_step_over_the_budget_stays_in_memory_and_warns_once(tmp_path):
    storage = DiskStorage(tmp_path, memory_budget_bytes=_budget_for(4, DIM, total=210))
    emb = DynamicEmbedding(DIM, storage=storage)
    opt = torch.optim.Adagrad(emb.parameters(), lr=0.1)
    with pytest.warns(RuntimeWarning, match=r"DiskStorage: \d+ rows in memory after spilling, over the \d+ that "
                                            r"memory_budget_bytes=\d+ holds.*fix: a larger `memory_budget_bytes`"):
        emb(torch.arange(200)).sum().backward()
        opt.step()
    assert emb.table.hot_rows == 200  # the step's own rows stay
    emb(torch.arange(200, 210)).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per table
        opt.step()
    assert emb.table.hot_rows < 200 and emb.num_rows == 210


def test_a_step_over_the_budget_gives_its_slots_back_once_they_spill_and_reads_are_counted(tmp_path):
    storage = DiskStorage(tmp_path, memory_budget_bytes=_budget_for(40, DIM, total=1010))
    ours, reference = DynamicEmbedding(DIM, storage=storage), DynamicEmbedding(DIM)
    batches = [torch.arange(1000), torch.arange(1000, 1010), torch.arange(0, 40, 2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the first step is over the budget, by design
        _train(ours, torch.optim.Adagrad, batches[:2], lr=0.1)
        hot = ours.table._hot
        assert hot.num_rows <= 40 and hot._used <= hot.num_rows + 16  # the first step's slots were handed back
        cold = int((ours.table._cold.find(batches[2]) >= 0).sum())
        read = ours.table.rows_read_back
        _train(ours, torch.optim.Adagrad, batches[2:], lr=0.1)
    assert cold > 0 and ours.table.rows_read_back - read == cold
    _train(reference, torch.optim.Adagrad, batches, lr=0.1)
    _assert_same(ours.state_dict(), reference.state_dict())


def _policy_table(storage=None) -> DynamicEmbedding:
    """A table whose rows leave by a time to live and a capacity (so deltas carry removed ids) and are made
    only when admitted (so they carry the admission sketch)."""
    return DynamicEmbedding(32, mode="sum", seed=7, eviction=EvictUnseen(10), capacity=330,
                            admission=AdmitAfter(2, sketch_width=4096, sketch_depth=4), storage=storage)


_NOT_ROWS = ("table_id", "disk")  # each table's own id and store; everything else in a save must be equal


def _assert_same_delta(ours: dict, theirs: dict) -> None:
    assert sorted(ours) == sorted(theirs)
    for key, value in theirs.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(ours[key], value), key
        else:
            assert {k: v for k, v in ours[key].items() if k not in _NOT_ROWS} == {
                k: v for k, v in value.items() if k not in _NOT_ROWS}, key


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # a step over the budget or the capacity, by design
def test_delta_checkpoints_and_serving_exports_over_both_tiers_equal_the_in_memory_tables(tmp_path):
    """With a quarter of the rows in memory, each delta (rows changed since the save in either tier, ids
    removed from either) and each serving export (full, then deltas) is the in-memory table's, byte for
    byte; the full save and its deltas load onto another disk tier (and onto memory) as the trained table."""
    budget = 60 * (4 * 2 * 32 + 25 + 32) + 200 * 100  # about a quarter of ~250 rows of 32 (and Adagrad's) in memory
    ours = _policy_table(DiskStorage(tmp_path / "ours", budget))
    reference = _policy_table()
    opts = [torch.optim.Adagrad(e.parameters(), lr=0.2) for e in (ours, reference)]
    saves: list[dict] = []
    cold_in_deltas = removed = 0
    for round_ in range(5):
        for ids in _batches(3 if round_ else 12, seed=10 + round_):
            for emb, opt in zip((ours, reference), opts):
                opt.zero_grad()
                emb(ids).pow(2).sum().mul(0.01).backward()
                opt.step()
        if round_:
            was_cold = ours.table._cold.find(ours.table.export()["ids"]) >= 0
        delta = ours.delta_state_dict(full=round_ == 0)
        _assert_same_delta(delta, reference.delta_state_dict(full=round_ == 0))
        if round_:
            changed = torch.isin(ours.table.export()["ids"], delta["ids"])
            cold_in_deltas += int((was_cold & changed).sum())
            removed += delta["removed"].numel()
        saves.append(delta)
        assert 0 < ours.table.hot_rows < ours.num_rows // 2  # most rows on disk at each save
        paths = [unison.embeddings.export_for_serving(e, tmp_path / f"{name}-{round_}", delta=round_ > 0)
                 for e, name in ((ours, "ours"), (reference, "theirs"))]
        for name in ("ids.bin", "rows.bin", "removed.bin"):
            assert (paths[0] / name).read_bytes() == (paths[1] / name).read_bytes(), (round_, name)
    assert cold_in_deltas > 0 and removed > 0  # the deltas hold cold rows and removals

    served = unison.embeddings.ServingEmbedding.load(tmp_path / "ours-0")
    for round_ in range(1, 5):
        served.apply_delta(tmp_path / f"ours-{round_}")
    state = reference.state_dict()
    assert served.num_rows == reference.num_rows and torch.equal(served._rows_of(state["ids"]), state["rows"])

    for storage in (DiskStorage(tmp_path / "restored", budget), None):
        restored = _policy_table(storage)
        restored.load_state_dict(saves[0])
        for delta in saves[1:]:
            restored.load_delta_state_dict(delta)
        _assert_same(restored.state_dict(), state)
        if storage is not None:
            _assert_within_budget(restored, budget)


@pytest.mark.filterwarnings("ignore:DiskStorage. .* rows in memory after spilling:RuntimeWarning")
def test_rows_still_in_flight_to_a_slow_disk_are_read_from_the_writer_and_train_exactly(tmp_path, monkeypatch):
    """Spills are written by a background thread; a row read back before its batch reached the disk comes
    from the batch in flight (never an older copy), so a slow disk changes no value."""
    import time

    from unison._embeddings.tables.disk.row_writer import RowWriter
    from unison._embeddings.tables.disk.storage import _Destination

    write, overlay, served = _Destination.__call__, RowWriter.overlay, [0]

    def slow_write(self, keys, values, mark):
        time.sleep(0.02)
        write(self, keys, values, mark)

    def counting_overlay(self, keys, out):
        found = overlay(self, keys, out)
        served[0] += int(found.sum())
        return found

    monkeypatch.setattr(_Destination, "__call__", slow_write)
    monkeypatch.setattr(RowWriter, "overlay", counting_overlay)
    batches = _batches(25, seed=9)
    reference = _train(DynamicEmbedding(DIM, mode="sum", seed=3), torch.optim.Adagrad, batches, lr=0.2)
    ours = _train(DynamicEmbedding(DIM, mode="sum", seed=3,
                                   storage=DiskStorage(tmp_path, _budget_for(IDS // 4, DIM))),
                  torch.optim.Adagrad, batches, lr=0.2)
    assert served[0] > 0  # some rows were read back while their batch was in flight
    _assert_same(ours.state_dict(), reference.state_dict())


@pytest.mark.filterwarnings("ignore:DiskStorage. .* rows in memory after spilling:RuntimeWarning")  # 40 new ids a step
def test_a_failed_disk_write_is_raised_by_the_next_step_naming_the_store(tmp_path, monkeypatch):
    from unison._embeddings.tables.disk.storage import _Destination

    def failing(self, keys, values, mark):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_Destination, "__call__", failing)
    emb = DynamicEmbedding(DIM, storage=DiskStorage(tmp_path, _budget_for(20, DIM, total=100)))
    with pytest.raises(RuntimeError, match=r"DiskStorage: writing rows to '.*local' failed: .*No space left on "
                                           r"device; the store is unusable now, fix: free disk space"):
        _new_ids_each_step(emb, 10)


def _new_ids_each_step(emb: DynamicEmbedding, steps: int, after: Callable[[Any], object] = lambda store: None) -> None:
    """``steps`` steps of 40 new ids each (rows spill from the first), each step's writes waited for, then
    ``after(store)``."""
    opt = torch.optim.Adagrad(emb.parameters(), lr=0.1)
    for start in range(0, 40 * steps, 40):
        emb(torch.arange(start, start + 40)).sum().backward()
        opt.step()
        emb.table._cold.store.flush()
        after(emb.table._cold.store)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


@pytest.mark.filterwarnings("ignore:DiskStorage. .* rows in memory after spilling:RuntimeWarning")
@pytest.mark.parametrize("how", ["closed", "let go"])
def test_a_stores_writer_process_ends_with_its_table(tmp_path, how):
    """The writes are applied by a process of the store's own; closing the table, or dropping it, ends it."""
    import gc

    emb = _train(DynamicEmbedding(DIM, mode="sum", storage=DiskStorage(tmp_path, _budget_for(20, DIM, total=100))),
                 torch.optim.Adagrad, _batches(5), lr=0.1)
    store = emb.table._cold.store
    store.flush()
    pid = store._process.pid
    assert pid is not None and _alive(pid)
    if how == "closed":
        emb.table.close()
    else:
        del emb, store
        gc.collect()  # a module, its optimizer hooks and its table refer to each other
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _alive(pid)


@pytest.mark.filterwarnings("ignore:DiskStorage. .* rows in memory after spilling:RuntimeWarning")
def test_a_table_let_go_mid_write_ends_its_writer_process_before_the_drop_returns(tmp_path, monkeypatch):
    """Where the last reference to a table goes (no close()), its queued writes are applied and its writer
    process ends right there, even while a write is in flight: the writer thread holds where the writes
    go, never the store, so the store is not kept alive past the drop. (The thread kept the store while
    it wrote: the process then outlived the drop until that write ended, and a test's leak check on a
    loaded machine saw it.)"""
    import gc

    from unison._embeddings.tables.disk.writer_process import WriterProcess

    write, started = WriterProcess.write, []

    def slow_write(self, *args):
        write(self, *args)
        started.append(self.pid)
        time.sleep(0.3)  # the drop below lands while this write is still in flight

    monkeypatch.setattr(WriterProcess, "write", slow_write)
    emb = DynamicEmbedding(DIM, storage=DiskStorage(tmp_path, _budget_for(4, DIM, total=40)))
    opt = torch.optim.Adagrad(emb.parameters(), lr=0.1)
    for ids in (torch.arange(36), torch.arange(36, 40)):  # the first step's rows spill after the second
        emb(ids).sum().backward()
        opt.step()  # a spill's write goes to the writer thread
    deadline = time.monotonic() + 10
    while not started and time.monotonic() < deadline:
        time.sleep(0.001)
    assert started and _alive(started[0]) and emb.table._cold.store._writer._queue.unfinished_tasks
    gc.disable()  # the drop itself must end it, not a later collection
    try:
        del emb, opt
        assert not _alive(started[0])
    finally:
        gc.enable()


@pytest.mark.filterwarnings("ignore:DiskStorage. .* rows in memory after spilling:RuntimeWarning")
def test_a_killed_writer_process_is_raised_by_the_next_step_naming_the_store(tmp_path):
    import os
    import signal

    def kill_its_writer(store: Any) -> None:
        if store._process.pid is not None:
            os.kill(store._process.pid, signal.SIGKILL)

    emb = DynamicEmbedding(DIM, storage=DiskStorage(tmp_path, _budget_for(20, DIM, total=100)))
    with pytest.raises(RuntimeError, match=r"DiskStorage: writing rows to '.*local' failed: the disk writer process "
                                           r"\d+ ended \(exit code -9\); the store is unusable now"):
        _new_ids_each_step(emb, 20, kill_its_writer)
    emb.table.close()


def test_the_writer_hands_freed_heap_pages_back_where_glibc_is():
    import ctypes.util

    from unison._embeddings.tables.disk.heap import trim_heap

    assert trim_heap() is (ctypes.util.find_library("c") is not None)
