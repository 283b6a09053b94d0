"""DynamicEmbedding under ParameterServerStrategy: rows on the ps tasks, real processes.

Chief (this process) + workers + ps tasks; each test compares with the same model trained
on one device, where rows made in the same order must have the same values.
"""

import re
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import unison
from tests.ps._cluster import ps_cluster
from unison import DynamicEmbedding
from unison._embeddings.tables.eviction import EvictBelowCount, EvictUnseen
from unison._embeddings.tables.id_hashing import shard_of
from unison.errors import ParameterServerError
from unison.optim import Ftrl

DIM = 4
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1


class Ranker(nn.Module):
    """Pooled dynamic rows into a linear head: a dense part and a sparse part."""

    def __init__(self, eviction=None):
        super().__init__()
        self.rows = DynamicEmbedding(DIM, mode="sum", eviction=eviction, seed=3,
                                     initializer=unison._embeddings.tables.initializers.uniform(-0.5, 0.5))
        self.head = nn.Linear(DIM, 1)

    def forward(self, ids):
        return self.head(self.rows(ids)).squeeze(1)


def _batches(count, seed=0, bag=3, batch=8):
    """Ids from the whole int64 range, both ends and negative ones included, some repeated."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.cat([torch.tensor([INT64_MIN, INT64_MAX, -1, 0]),
                      torch.randint(INT64_MIN, INT64_MAX, (28,), generator=g, dtype=torch.int64)])
    out = []
    for _ in range(count):
        ids = pool[torch.randint(0, pool.numel(), (batch, bag), generator=g)]
        out.append((ids, torch.randn(batch, generator=g)))
    return out


def _train_step(model, optimizer):
    def step(ids, target):
        loss = F.mse_loss(model(ids), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.detach()
    return step


def _one_device(batches, eviction=None, optimizer=torch.optim.Adagrad, **hyper):
    torch.manual_seed(0)
    model = Ranker(eviction)
    opt = optimizer(model.parameters(), **hyper)
    step = _train_step(model, opt)
    losses = [step(ids, target) for ids, target in batches]
    return model, losses


def _cluster_model(cluster, workers, ps, eviction=None, optimizer=torch.optim.Adagrad, timeout_seconds=30, **hyper):
    strategy = unison.ParameterServerStrategy(cluster.resolver(workers, ps), timeout_seconds=timeout_seconds)
    coordinator = unison.ClusterCoordinator(strategy)
    torch.manual_seed(0)
    with strategy.scope():
        model = Ranker(eviction)
        opt = optimizer(model.parameters(), **hyper)
    return strategy, coordinator, model, opt


@pytest.mark.timeout(90)
def test_two_workers_two_ps_train_as_one_device_and_move_only_their_rows_then_reshard():
    batches = _batches(12)
    reference, reference_losses = _one_device(batches, lr=0.3)
    with ps_cluster(2, 2) as cluster:
        strategy, coordinator, model, opt = _cluster_model(cluster, 2, 2, lr=0.3)
        step = _train_step(model, opt)

        losses = []
        for ids, target in batches:  # one function at a time: the order of pushes is the one-device order
            losses.append(coordinator.schedule(step, args=(ids, target)).fetch())
        torch.testing.assert_close(torch.stack(losses), torch.stack(reference_losses), rtol=1e-4, atol=1e-5)
        ours, theirs = model.state_dict(), reference.state_dict()
        assert torch.equal(ours["rows.ids"], theirs["rows.ids"])  # the same rows exist...
        torch.testing.assert_close(ours["rows.rows"], theirs["rows.rows"], rtol=1e-4, atol=1e-5)  # ...with its values
        torch.testing.assert_close(ours["rows.state.sum"], theirs["rows.state.sum"], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(ours["head.weight"], theirs["head.weight"], rtol=1e-4, atol=1e-5)
        assert ours["rows.ids"].min() == INT64_MIN and ours["rows.ids"].max() == INT64_MAX

        # each ps task holds exactly the ids that hash to it, and the coordinator can count them
        stats = model.rows.table_stats()
        owners = shard_of(ours["rows.ids"], 2)
        assert [s["rows"] for s in stats] == [int((owners == k).sum()) for k in range(2)]
        assert all(s["bytes"] > s["rows"] * DIM * 4 for s in stats)
        assert model.rows.num_rows == ours["rows.ids"].numel()

        # evaluation on the coordinator reads the rows where they live and makes none
        with torch.no_grad():
            model.eval()
            unseen = torch.tensor([[123456789, -987654321, 5]])
            torch.testing.assert_close(model(unseen), reference.eval()(unseen), rtol=1e-4, atol=1e-5)
            model.train()
        assert model.rows.num_rows == ours["rows.ids"].numel()
        coordinator.shutdown()

    # the 2-ps checkpoint loads into 3 ps tasks (rows re-split by hash) and into one device
    with ps_cluster(1, 3) as cluster:
        strategy, coordinator, model3, opt3 = _cluster_model(cluster, 1, 3, lr=0.3)
        model3.load_state_dict(ours)
        stats = model3.rows.table_stats()
        owners = shard_of(ours["rows.ids"], 3)
        assert [s["rows"] for s in stats] == [int((owners == k).sum()) for k in range(3)]
        again = model3.state_dict()
        for key in ("rows.ids", "rows.rows", "rows.state.sum", "rows.counts", "rows.last_seen"):
            assert torch.equal(again[key], ours[key]), key
        # training goes on from the checkpoint as it would on one device
        more = _batches(3, seed=1)
        step3 = _train_step(model3, opt3)
        got = [coordinator.schedule(step3, args=batch).fetch() for batch in more]
        local = Ranker()
        local.load_state_dict(ours)
        local_opt = torch.optim.Adagrad(local.parameters(), lr=0.3)
        want = [_train_step(local, local_opt)(*batch) for batch in more]
        torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=1e-4, atol=1e-5)
        coordinator.shutdown()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("eviction, batch", [(EvictUnseen(2), 3), (EvictBelowCount(2), 8)], ids=repr)
def test_eviction_on_the_ps_removes_exactly_the_rows_the_policy_names(eviction, batch):
    batches = _batches(8, seed=2, bag=2, batch=batch)
    reference, _ = _one_device(batches, eviction=eviction, optimizer=torch.optim.SGD, lr=0.1)
    with ps_cluster(1, 2) as cluster:
        strategy, coordinator, model, opt = _cluster_model(cluster, 1, 2, eviction=eviction,
                                                           optimizer=torch.optim.SGD, lr=0.1)
        step = _train_step(model, opt)
        for ids, target in batches:
            coordinator.schedule(step, args=(ids, target)).fetch()
        ours, theirs = model.state_dict(), reference.state_dict()
        seen = torch.unique(torch.cat([ids.reshape(-1) for ids, _ in batches]))
        assert 0 < ours["rows.ids"].numel() < seen.numel()  # the policy removed some rows, not all
        assert torch.equal(ours["rows.ids"], theirs["rows.ids"])
        torch.testing.assert_close(ours["rows.rows"], theirs["rows.rows"], rtol=1e-4, atol=1e-5)
        coordinator.shutdown()


def _slow_step(model, optimizer):
    def step(ids, target):
        from unison._ps.worker.runtime import RUNTIME  # the worker's, not a pickled copy of ours

        time.sleep(0.02)
        loss = F.mse_loss(model(ids), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return RUNTIME.current.worker_index
    return step


@pytest.mark.timeout(90)
def test_a_killed_workers_functions_run_again_and_a_killed_ps_is_named_in_time():
    batches = _batches(40, seed=4)
    with ps_cluster(2, 2) as cluster:
        strategy, coordinator, model, opt = _cluster_model(cluster, 2, 2, timeout_seconds=5, lr=0.1)
        step = _slow_step(model, opt)
        results = [coordinator.schedule(step, args=batch) for batch in batches]
        deadline = time.monotonic() + 30
        while sum(r.done() for r in results) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        cluster.kill("worker:1")
        coordinator.join()
        assert all(r.fetch() in (0, 1) for r in results)  # every function ran, the killed worker's again
        assert model.rows.num_rows > 0
        cluster.kill("ps:1")
        start = time.monotonic()
        with pytest.raises(ParameterServerError, match=re.escape("ps:1")):
            for _ in range(1000):
                coordinator.schedule(step, args=batches[0])
                coordinator.join()
        assert time.monotonic() - start < 5 + 10
        coordinator.shutdown()


class MultiHot(nn.Module):
    """Long bags of ids (a user's history): pooling them on the ps tasks saves bytes."""

    def __init__(self, mode):
        super().__init__()
        self.rows = DynamicEmbedding(DIM, mode=mode, seed=11,
                                     initializer=unison._embeddings.tables.initializers.uniform(-0.5, 0.5))
        self.head = nn.Linear(DIM, 1)

    def forward(self, ids, offsets=None, weights=None):
        return self.head(self.rows(ids, offsets, weights)).squeeze(1)


def _multi_hot_batches(count, seed=7):
    g = torch.Generator().manual_seed(seed)
    pool = torch.randint(INT64_MIN, INT64_MAX, (200,), generator=g, dtype=torch.int64)
    out = []
    for _ in range(count):
        lengths = torch.tensor([30, 0, 25, 41])  # an empty bag too
        ids = pool[torch.randint(0, 200, (int(lengths.sum()),), generator=g)]
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
        out.append((ids, offsets, torch.rand(ids.numel(), generator=g), torch.randn(4, generator=g)))
    return out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_long_bags_are_pooled_on_the_ps_and_train_as_on_one_device(mode):
    batches = _multi_hot_batches(5)
    weighted = mode == "sum"

    def make_step(model, optimizer):
        def step(ids, offsets, weights, target):
            loss = F.mse_loss(model(ids, offsets, weights if weighted else None), target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            return loss.detach(), dict(getattr(model.rows.table, "traffic", {}))
        return step

    torch.manual_seed(0)
    local = MultiHot(mode)
    local_step = make_step(local, torch.optim.Adagrad(local.parameters(), lr=0.2))
    want = [local_step(*batch)[0] for batch in batches]
    with ps_cluster(1, 2) as cluster:
        strategy = unison.ParameterServerStrategy(cluster.resolver(1, 2))
        coordinator = unison.ClusterCoordinator(strategy)
        torch.manual_seed(0)
        with strategy.scope():
            model = MultiHot(mode)
            opt = torch.optim.Adagrad(model.parameters(), lr=0.2)
        step = make_step(model, opt)
        got = [coordinator.schedule(step, args=batch).fetch() for batch in batches]
        assert all(traffic == {"rows": 0, "pooled": 1} for _, traffic in got)  # bags pooled where rows live
        torch.testing.assert_close(torch.stack([loss for loss, _ in got]), torch.stack(want), rtol=1e-4, atol=1e-5)
        ours, theirs = model.state_dict(), local.state_dict()
        assert (torch.equal(ours["rows.ids"], theirs["rows.ids"])
                and torch.equal(ours["rows.counts"], theirs["rows.counts"]))
        torch.testing.assert_close(ours["rows.rows"], theirs["rows.rows"], rtol=1e-4, atol=1e-5)
        coordinator.shutdown()


@pytest.mark.timeout(90)
def test_a_fixed_table_marked_for_the_ps_keeps_its_rows_there():
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randint(0, 30, (6, 2), generator=g), torch.randn(6, generator=g)) for _ in range(3)]

    replaced = []

    def build():
        torch.manual_seed(0)
        fixed = nn.EmbeddingBag(30, DIM, mode="sum")
        replaced.append(fixed.weight)
        return nn.Sequential(unison.embeddings.on_ps(fixed), nn.Linear(DIM, 1), nn.Flatten(0))

    local = build()
    local_step = _train_step(local, torch.optim.Adagrad(local.parameters(), lr=0.2))
    want = [local_step(*batch) for batch in batches]
    with ps_cluster(1, 2) as cluster:
        strategy = unison.ParameterServerStrategy(cluster.resolver(1, 2))
        coordinator = unison.ClusterCoordinator(strategy)
        with strategy.scope():
            model = build()
            opt = torch.optim.Adagrad(model.parameters(), lr=0.2)
        assert not replaced[-1]._ps_remote  # the replaced table was never sent to a ps task
        assert [s["rows"] for s in model[0].table_stats()] == [int((shard_of(torch.arange(30), 2) == k).sum())
                                                              for k in range(2)]
        step = _train_step(model, opt)
        got = [coordinator.schedule(step, args=batch).fetch() for batch in batches]
        torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(model.state_dict()["0.rows"], local.state_dict()["0.rows"], rtol=1e-4, atol=1e-5)
        coordinator.shutdown()


def _steps_with(model, optimizers):
    """A training step stepping several optimizers (SparseAdam's rows beside Adam's dense layers)."""
    def step(ids, target):
        loss = F.mse_loss(model(ids), target)
        for optimizer in optimizers:
            optimizer.zero_grad()
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()
        return loss.detach()
    return step


ROW_OPTIMIZERS = {
    "sparse_adam": lambda model: [torch.optim.SparseAdam(model.rows.parameters(), lr=0.05, betas=(0.8, 0.95)),
                                  torch.optim.Adam(model.head.parameters(), lr=0.05)],
    "ftrl": lambda model: [Ftrl(model.parameters(), lr=0.2, lr_power=-0.6, initial_accumulator_value=0.05,
                                l1=0.002, l2=0.01, l2_shrinkage=0.005, beta=0.1)],
}
ROW_STATE = {"sparse_adam": ("exp_avg", "exp_avg_sq"), "ftrl": ("accumulator", "linear")}


def _ftrl_with_lr_zero(model):
    optimizer = Ftrl(model.parameters())
    optimizer.param_groups[0]["lr"] = 0.0  # as a scheduler could set it
    return [optimizer]


BAD_OPTIMIZERS = {  # refused on the worker, naming the fix
    "sparse_adam": (lambda model: [torch.optim.Adam(model.parameters(), lr=0.1)], "SparseAdam"),
    "ftrl": (_ftrl_with_lr_zero, "`lr`.* must be > 0, got 0.0"),
}


def _assert_same_model(ours, theirs, name):
    assert torch.equal(ours["rows.ids"], theirs["rows.ids"])
    assert ours["rows._extra_state"]["step"] == theirs["rows._extra_state"]["step"]  # SparseAdam's t
    for key in ("rows.rows", *(f"rows.state.{s}" for s in ROW_STATE[name]), "head.weight", "head.bias"):
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-4, atol=1e-5, msg=key)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(ROW_OPTIMIZERS))
def test_sparse_adam_and_ftrl_rows_on_two_ps_train_as_one_device_and_their_checkpoint_round_trips(name):
    batches = _batches(9, seed=6, bag=1, batch=2)
    # pushes whose ids all live on one ps task: the other shard's step count t advances all the same
    assert any(shard_of(ids.reshape(-1), 2).unique().numel() == 1 for ids, _ in batches[:6])
    torch.manual_seed(0)
    reference = Ranker()
    reference_step = _steps_with(reference, ROW_OPTIMIZERS[name](reference))
    want = [reference_step(*batch) for batch in batches]
    with ps_cluster(1, 2) as cluster:
        strategy = unison.ParameterServerStrategy(cluster.resolver(1, 2), timeout_seconds=30)
        coordinator = unison.ClusterCoordinator(strategy)
        torch.manual_seed(0)
        with strategy.scope():
            model = Ranker()
            optimizers = ROW_OPTIMIZERS[name](model)
        step = _steps_with(model, optimizers)
        got = [coordinator.schedule(step, args=batch).fetch() for batch in batches[:6]]
        torch.testing.assert_close(torch.stack(got), torch.stack(want[:6]), rtol=1e-4, atol=1e-5)
        saved, saved_optimizers = model.state_dict(), [optimizer.state_dict() for optimizer in optimizers]
        assert saved["rows._extra_state"]["step"] == 6

        # train on, then restore the checkpoint (rows, row state, t on every shard, dense state) and train again
        on = [coordinator.schedule(step, args=batch).fetch() for batch in batches[6:]]
        trained_on = model.state_dict()
        model.load_state_dict(saved)
        for optimizer, state in zip(optimizers, saved_optimizers):
            optimizer.load_state_dict(state)
        again = [coordinator.schedule(step, args=batch).fetch() for batch in batches[6:]]
        torch.testing.assert_close(torch.stack(again), torch.stack(on), rtol=0, atol=0)
        _assert_same_model(model.state_dict(), trained_on, name)
        torch.testing.assert_close(torch.stack(on), torch.stack(want[6:]), rtol=1e-4, atol=1e-5)
        _assert_same_model(model.state_dict(), reference.state_dict(), name)

        # bad input (Adam over the table, Ftrl with lr 0) is refused on the worker before anything moves
        before = model.state_dict()
        make_bad, message = BAD_OPTIMIZERS[name]
        with pytest.raises(ValueError, match=message):
            coordinator.schedule(_steps_with(model, make_bad(model)), args=batches[0]).fetch()
        _assert_same_model(model.state_dict(), before, name)
        coordinator.shutdown()
