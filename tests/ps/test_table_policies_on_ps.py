"""Table policies with rows on ps tasks (real processes) against one device: admission, capacity and
a time to live (a clock every process reads from a file) under ParameterServerStrategy, one function
at a time, and under the hybrid strategy with disjoint ids; checkpoints re-split from 2 ps tasks to 3.
"""

import math

import pytest
import torch

import unison
from tests.ps import _policy_workers as pw
from tests.ps._cluster import ps_cluster
from unison import DynamicEmbedding
from unison._embeddings.optim.row_optimizers import RowSGD
from unison._embeddings.tables.id_hashing import shard_of
from unison._embeddings.tables.local_table import LocalTable
from unison._testing import run_workers
from unison.embeddings import AdmitAfter, EvictUnseen

KEYS = ("ids", "counts", "last_seen")


def _assert_tables_equal(ours, theirs, prefix):
    """A table's rows, counters and policy state, and (for PolicyRanker) its head (under the
    hybrid strategy a shard's clock moves once per global step, as one device's)."""
    head = prefix.replace("tables.", "heads.") + "weight"
    if head in ours:
        torch.testing.assert_close(ours[head], theirs[head], rtol=1e-4, atol=1e-5, msg=head)
    for key in KEYS:
        assert torch.equal(ours[prefix + key], theirs[prefix + key]), prefix + key
    torch.testing.assert_close(ours[prefix + "rows"], theirs[prefix + "rows"], rtol=1e-4, atol=1e-5, msg=prefix)
    for key in ("pending_counts", "idle_seconds"):
        assert (prefix + key in ours) == (prefix + key in theirs), prefix + key
        if prefix + key in ours:
            assert torch.equal(ours[prefix + key], theirs[prefix + key]), prefix + key


def _one_device(batches, clock, **kwargs):
    torch.manual_seed(0)
    model = pw.PolicyRanker(clock, **kwargs)
    step = pw.train_step(model, torch.optim.Adagrad(model.parameters(), lr=0.2))
    for ids, target in batches:
        step(ids, target)
        clock.advance(2.0)
    return model


def _on_ps(strategy, coordinator, batches, clock, **kwargs):
    torch.manual_seed(0)
    with strategy.scope():
        model = pw.PolicyRanker(clock, **kwargs)
        opt = torch.optim.Adagrad(model.parameters(), lr=0.2)
    step = pw.train_step(model, opt)
    for ids, target in batches:  # one function at a time: the pushes in the one-device order
        coordinator.schedule(step, args=(ids, target)).fetch()
        clock.advance(2.0)
    return model


@pytest.mark.timeout(120)
def test_every_policy_on_one_ps_task_equals_one_device(tmp_path):
    batches = pw.policy_batches(12)
    clock = pw.FileClock(tmp_path / "clock")
    clock.set(1000.0)
    reference = _one_device(batches, clock).state_dict()
    with ps_cluster(1, 1) as cluster:
        strategy = unison.ParameterServerStrategy(cluster.resolver(1, 1))
        coordinator = unison.ClusterCoordinator(strategy)
        with strategy.scope(), pytest.raises(ValueError, match="`capacity` must be an int >= 1"):
            DynamicEmbedding(pw.DIM, capacity=0)
        clock.set(1000.0)
        model = _on_ps(strategy, coordinator, batches, clock)
        assert model.tables["admit"].table.key == "0:dynamic_table"  # the refused module made no table
        ours = model.state_dict()
        for name in model.tables:
            _assert_tables_equal(ours, reference, f"tables.{name}.")
        seen = torch.unique(torch.cat([ids.reshape(-1) for ids, _ in batches])).numel()
        rows = {name: ours[f"tables.{name}.ids"].numel() for name in model.tables}
        # every policy did something: ids without a row, rows evicted over capacity or unseen for too long
        assert all(0 < n < seen for n in rows.values()), (rows, seen)
        assert rows["lru"] <= 10 and rows["lfu"] <= 10
        coordinator.shutdown()


def _per_shard_reference(batches, num_shards, capacity):
    """What each ps shard of an LRU table must keep: a LocalTable per shard seeing its ids' lookups and pushes."""
    tables = [LocalTable(pw.DIM, capacity=math.ceil(capacity / num_shards)) for _ in range(num_shards)]
    for ids, _ in batches:
        flat = ids.reshape(-1)
        owner = shard_of(flat, num_shards)
        for k, table in enumerate(tables):
            mine = flat[owner == k]
            table.lookup(mine)
            table.push(mine, torch.zeros(mine.numel(), pw.DIM), RowSGD(lr=0.0))
    return [table.export() for table in tables]


@pytest.mark.timeout(150)
@pytest.mark.filterwarnings("ignore:LocalTable. .* rows after evicting:RuntimeWarning")  # a batch of 8 ids, capacity 7
def test_on_two_ps_tasks_each_shard_keeps_its_share_and_a_checkpoint_resplits_onto_three(tmp_path):
    batches, more = pw.policy_batches(10, seed=1), pw.policy_batches(4, seed=2)
    clock = pw.FileClock(tmp_path / "clock")
    clock.set(1000.0)
    reference = _one_device(batches, clock, capacity=7)
    with ps_cluster(1, 2) as cluster:
        strategy = unison.ParameterServerStrategy(cluster.resolver(1, 2))
        coordinator = unison.ClusterCoordinator(strategy)
        clock.set(1000.0)
        model = _on_ps(strategy, coordinator, batches, clock, capacity=7)
        ours = model.state_dict()
        for name in ("admit", "draw", "ttl"):  # per-id policies: the same rows as one device
            _assert_tables_equal(ours, reference.state_dict(), f"tables.{name}.")
        # a capacity of 7 is 4 rows per shard, each kept by the one-device rule among its own ids
        stats = [s["rows"] for s in model.tables["lru"].table_stats()]
        shards = _per_shard_reference(batches, 2, 7)
        assert stats == [s["ids"].numel() for s in shards] and max(stats) <= 4
        owner = shard_of(ours["tables.lru.ids"], 2)
        for k, shard in enumerate(shards):
            assert torch.equal(ours["tables.lru.ids"][owner == k], shard["ids"])
            assert torch.equal(ours["tables.lru.last_seen"][owner == k], shard["last_seen"])
        coordinator.shutdown()

    # the 2-ps checkpoint (rows, admission counts, idle seconds) onto 3 ps tasks and onto one device
    with ps_cluster(1, 3) as cluster:
        strategy = unison.ParameterServerStrategy(cluster.resolver(1, 3))
        coordinator = unison.ClusterCoordinator(strategy)
        with strategy.scope():
            model3 = pw.PolicyRanker(clock, capacity=7)
            opt3 = torch.optim.Adagrad(model3.parameters(), lr=0.2)
        model3.load_state_dict(ours)
        again = model3.state_dict()
        for name in ("admit", "draw", "ttl"):
            _assert_tables_equal(again, ours, f"tables.{name}.")
        local = pw.PolicyRanker(clock, capacity=7)
        local.load_state_dict(ours)
        local_step = pw.train_step(local, torch.optim.Adagrad(local.parameters(), lr=0.2))
        step3 = pw.train_step(model3, opt3)
        for ids, target in more:
            coordinator.schedule(step3, args=(ids, target)).fetch()
            local_step(ids, target)
            clock.advance(2.0)
        theirs, ours3 = local.state_dict(), model3.state_dict()
        for name in ("admit", "draw", "ttl"):  # admission goes on from the counts saved on 2 ps tasks
            _assert_tables_equal(ours3, theirs, f"tables.{name}.")
        assert ours3["tables.admit.ids"].numel() > ours["tables.admit.ids"].numel()  # ids admitted after the load
        assert max(s["rows"] for s in model3.tables["lru"].table_stats()) <= 3 + 8  # ceil(7 / 3), or a step's ids
        coordinator.shutdown()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("optimizer", ["adagrad", "sparse_adam", "ftrl"])
def test_under_the_hybrid_strategy_disjoint_ids_see_every_policy_as_one_device_on_the_global_batch(tmp_path, optimizer):
    """Each worker pushes every global step, naming it: a shard steps once per global step (SparseAdam's t,
    the capacity's and time to live's last-seen steps), as one device on the global batch."""
    steps, capacity = 6, 16  # two global steps of new ids: the capacity evicts whole steps
    reference = pw.hybrid_reference(steps, 2, str(tmp_path / "reference_clock"), capacity, optimizer)
    clock = pw.FileClock(tmp_path / "clock")
    clock.set(100.0)
    with ps_cluster(0, 1) as cluster:
        ps = [cluster.addresses["ps:0"]]
        results = run_workers(pw.hybrid_train, 2, args=(ps, cluster.key_hex, steps, clock.path, capacity, optimizer),
                              timeout=120)
    ours = results[0]
    for name in ("admit", "cap", "ttl"):
        _assert_tables_equal(ours, reference, f"{name}.")
    assert torch.equal(results[1]["admit.rows"], ours["admit.rows"])
    assert ours["cap.ids"].numel() == capacity and ours["cap.ids"].min() == 10**6 * (steps - 1)  # the last two steps
    assert 0 < ours["admit.ids"].numel() < 12 and 0 < ours["ttl.ids"].numel() < 12
    for key in ("dense.weight", "head.weight", "head.bias"):
        torch.testing.assert_close(ours[key], reference[key], rtol=1e-5, atol=1e-6, msg=key)


def test_a_time_to_live_policy_pickles_its_clock_by_reference(tmp_path):
    import pickle

    clock = pw.FileClock(tmp_path / "c")
    policy = pickle.loads(pickle.dumps(EvictUnseen(3, seconds=1.5, clock=clock)))
    assert repr(policy) == f"EvictUnseen(steps=3, seconds=1.5, clock=FileClock({clock.path!r}))"
    default = pickle.loads(pickle.dumps(EvictUnseen(seconds=1.5)))
    assert repr(default) == "EvictUnseen(seconds=1.5)" and default.clock is __import__("time").monotonic
    assert repr(AdmitAfter(2)) == "AdmitAfter(2)"
    assert repr(AdmitAfter(2, sketch_width=8)) == "AdmitAfter(2, sketch_width=8)"
