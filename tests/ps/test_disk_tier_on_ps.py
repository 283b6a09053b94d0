"""The disk tier on 2 ps tasks (real processes), one function at a time: each ps task keeps its shard's hot
rows within the budget and the rest under ``path/ps-K/<table>``, and the table trains as one device's in
memory, saves the same deltas and serving exports; its checkpoint loads onto one device."""

import pytest
import torch

pytest.importorskip("lmdb", reason="the disk tier needs lmdb: pip install 'unison[disk]' (make install does)")

import unison  # noqa: E402
from tests.ps import _policy_workers as pw  # noqa: E402
from tests.ps._cluster import ps_cluster  # noqa: E402
from unison import DynamicEmbedding  # noqa: E402
from unison.embeddings import DiskStorage, EvictUnseen, export_for_serving  # noqa: E402

IDS, DIM = 300, 16  # rows of 16 values: a hot row (with its Adagrad sum) takes well more than a cold one's index
BUDGET = 38 * (4 * 2 * DIM + 25 + 32) + 112 * 80  # per ps task: about a quarter of its ~150 rows hot


class DiskRanker(torch.nn.Module):
    """A pooled table with Adagrad state and a time to live, and a linear head."""

    def __init__(self, storage=None):
        super().__init__()
        self.table = DynamicEmbedding(DIM, mode="sum", seed=9, eviction=EvictUnseen(15), storage=storage)
        self.head = torch.nn.Linear(DIM, 1)

    def forward(self, ids):
        return self.head(self.table(ids)).squeeze(1)


def _rows_on_disk(directory):
    """Rows in the LMDB store of a ps task's table (read from this process: LMDB takes other readers)."""
    import lmdb

    (store,) = [p for p in directory.rglob("rows-*") if p.is_dir()]
    with lmdb.open(str(store), readonly=True, lock=False, max_dbs=3) as env, env.begin() as txn:
        return txn.stat(env.open_db(b"rows", txn=txn, create=False))["entries"]


def _batches(count, seed=0):
    g = torch.Generator().manual_seed(seed)
    skew = torch.linspace(3.0, 0.2, IDS)
    return [((torch.multinomial(skew, 32 * 2, replacement=True, generator=g) * 7919 - 2**40).reshape(32, 2),
             torch.randn(32, generator=g)) for _ in range(count)]


def _same_save(ours, theirs):
    """Two delta (or full) saves hold the same rows, state, counters and removals (each table has its own id)."""
    assert sorted(ours) == sorted(theirs)
    for key, value in theirs.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(ours[key], value), key


def _same_serving_export(ours, theirs):
    for name in ("ids.bin", "rows.bin", "removed.bin"):
        assert (ours / name).read_bytes() == (theirs / name).read_bytes(), name


@pytest.mark.timeout(150)
@pytest.mark.filterwarnings("ignore:DiskStorage. .* rows in memory after spilling:RuntimeWarning")
def test_two_ps_tasks_with_a_quarter_of_their_rows_in_memory_train_as_one_device(tmp_path):
    """Training, a full save and a delta after it, and serving exports (full, delta) equal one device's."""
    batches = _batches(20)
    torch.manual_seed(0)
    reference = DiskRanker()
    step = pw.train_step(reference, torch.optim.Adagrad(reference.parameters(), lr=0.2))
    saves = {}
    for i, (ids, target) in enumerate(batches):
        step(ids, target)
        if i in (9, 19):
            saves[i] = reference.table.delta_state_dict(full=i == 9)
            export_for_serving(reference.table, tmp_path / f"theirs-{i}", delta=i == 19)
    with ps_cluster(1, 2) as cluster:
        strategy = unison.ParameterServerStrategy(cluster.resolver(1, 2))
        coordinator = unison.ClusterCoordinator(strategy)
        torch.manual_seed(0)
        with strategy.scope():
            model = DiskRanker(DiskStorage(tmp_path / "rows", memory_budget_bytes=BUDGET))
            opt = torch.optim.Adagrad(model.parameters(), lr=0.2)
        remote_step = pw.train_step(model, opt)
        for i, (ids, target) in enumerate(batches):  # one function at a time: the pushes in the one-device order
            coordinator.schedule(remote_step, args=(ids, target)).fetch()
            if i in (9, 19):  # the delta holds rows changed on disk and in memory, and ids removed from both
                _same_save(model.table.delta_state_dict(full=i == 9), saves[i])
                ours = export_for_serving(model.table, tmp_path / f"ours-{i}", delta=i == 19)
                _same_serving_export(ours, tmp_path / f"theirs-{i}")
        assert saves[19]["removed"].numel() > 0
        ours, theirs = model.state_dict(), reference.state_dict()
        assert sorted(ours) == sorted(theirs)
        for key in ("table.ids", "table.counts", "table.last_seen", "table.rows", "table.state.sum"):
            assert torch.equal(ours[key], theirs[key]), key
        torch.testing.assert_close(ours["head.weight"], theirs["head.weight"], rtol=1e-5, atol=1e-6)
        # each ps task spilled to its own directory, and keeps what its budget holds in memory
        for k, stats in enumerate(model.table.table_stats()):
            on_disk = _rows_on_disk(tmp_path / "rows" / f"ps-{k}")
            # the store holds the cold rows and the (shadow) copies of rows read back since
            assert stats["rows"] / 2 < on_disk <= stats["rows"], (k, stats, on_disk)
        # the checkpoint, with every ps task's disk rows, loads onto one device
        local = DiskRanker()
        local.load_state_dict(ours)
        assert torch.equal(local.state_dict()["table.rows"], theirs["table.rows"])
        coordinator.shutdown()


@pytest.mark.timeout(180)
@pytest.mark.filterwarnings("ignore:DiskStorage. .* rows in memory after spilling:RuntimeWarning")
def test_restarted_ps_tasks_resume_from_their_files_and_the_checkpoint(tmp_path):
    """ps tasks killed after training past a checkpoint, restarted on the same path: the checkpoint loads
    keeping each task's store (the rows written after it rolled back), and training goes on as one device
    loaded from the same checkpoint."""
    batches = _batches(22, seed=1)
    storage = DiskStorage(tmp_path / "rows", memory_budget_bytes=BUDGET)
    with ps_cluster(1, 2) as cluster:
        strategy = unison.ParameterServerStrategy(cluster.resolver(1, 2))
        coordinator = unison.ClusterCoordinator(strategy)
        torch.manual_seed(0)
        with strategy.scope():
            model = DiskRanker(storage)
            opt = torch.optim.Adagrad(model.parameters(), lr=0.2)
        remote_step = pw.train_step(model, opt)
        for ids, target in batches[:10]:
            coordinator.schedule(remote_step, args=(ids, target)).fetch()
        saved = model.state_dict()
        for ids, target in batches[10:16]:  # trained past the checkpoint, then the ps tasks die
            coordinator.schedule(remote_step, args=(ids, target)).fetch()
        cluster.kill("ps:0")
        cluster.kill("ps:1")
    stores = saved["table._extra_state"]["disk"]
    assert sorted(stores) == ["ps-0/0_dynamic_table", "ps-1/0_dynamic_table"]

    with ps_cluster(1, 2) as cluster:  # the restarted job: new processes, the same storage path
        strategy = unison.ParameterServerStrategy(cluster.resolver(1, 2))
        coordinator = unison.ClusterCoordinator(strategy)
        with strategy.scope():
            model = DiskRanker(storage)
            opt = torch.optim.Adagrad(model.parameters(), lr=0.2)
        model.load_state_dict(saved)
        for place, sealed in stores.items():  # each ps task kept its store (a full reload makes a new one)
            assert [p.name for p in (tmp_path / "rows" / place).iterdir()] == [sealed["store"]], place
        ours = model.state_dict()
        for key in ("table.ids", "table.counts", "table.last_seen", "table.rows", "table.state.sum"):
            assert torch.equal(ours[key], saved[key]), key
        reference = DiskRanker()
        reference.load_state_dict(saved)
        step = pw.train_step(reference, torch.optim.Adagrad(reference.parameters(), lr=0.2))
        remote_step = pw.train_step(model, opt)
        for ids, target in batches[10:]:
            step(ids, target)
            coordinator.schedule(remote_step, args=(ids, target)).fetch()
        ours, theirs = model.state_dict(), reference.state_dict()
        for key in ("table.ids", "table.counts", "table.last_seen", "table.rows", "table.state.sum"):
            assert torch.equal(ours[key], theirs[key]), key
        coordinator.shutdown()
