"""Chief + 2 workers + 2 ps: training, placement, sharding, reads on the coordinator."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import unison
from tests.ps._cluster import ps_cluster
from unison._ps.worker.runtime import RUNTIME
from unison.errors import UsageError


def _worker_index():
    return RUNTIME.current.worker_index


def _shared_ps_tasks():
    """The ps tasks that have mapped this worker's shared-memory arena."""
    return sorted(i for i, segments in RUNTIME.current.client._attached.items() if segments)


def _rows_pulled():
    return sum(rows.shape[0] for _, _, rows in RUNTIME.current._rows)


@pytest.mark.timeout(60)
def test_regression_trains_on_two_workers_and_two_ps():
    torch.manual_seed(0)
    true_w = torch.randn(8, 1)
    with ps_cluster(2, 2) as cluster:
        strategy = unison.ParameterServerStrategy(cluster.resolver(2, 2))
        coordinator = unison.ClusterCoordinator(strategy)
        assert unison.ClusterCoordinator(strategy) is coordinator
        with strategy.scope():
            model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
            optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

        def dataset_fn(context):
            g = torch.Generator().manual_seed(context.input_pipeline_id)
            x = torch.randn(16384, 8, generator=g)
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x @ true_w), batch_size=64)

        iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

        def step(it):
            x, y = next(it)
            loss = F.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            return loss.detach(), _worker_index(), _shared_ps_tasks()

        # the loss before training, read on the coordinator: the first function scheduled need not run
        # first (the other worker may have stepped already), so its loss is no baseline
        probe = torch.randn(256, 8, generator=torch.Generator().manual_seed(99))
        with torch.no_grad():
            initial = F.mse_loss(model(probe), probe @ true_w).item()
        results = [coordinator.schedule(step, args=(iterator,)) for _ in range(100)]
        coordinator.join()
        assert coordinator.done()
        losses = [coordinator.fetch(r)[0].item() for r in results]
        assert {coordinator.fetch(r)[1] for r in results} == {0, 1}  # both workers took functions
        assert coordinator.fetch(results[-1])[2] == [0, 1]  # one host: values moved through shared memory
        assert sum(losses[-10:]) / 10 < 0.3 < 3 < initial
        # reads on the coordinator come from the ps tasks and match a local evaluation
        state = model.state_dict()
        assert all(type(v) is torch.Tensor for v in state.values())
        plain = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        plain.load_state_dict(state)
        x = torch.randn(256, 8)
        assert F.mse_loss(plain(x), x @ true_w).item() < 0.3
        torch.testing.assert_close(model(x), plain(x))
        coordinator.shutdown()
        assert cluster.stop() == {name: 0 for name in cluster.procs}


@pytest.mark.timeout(60)
def test_sharded_embedding_moves_only_touched_rows_and_loads_into_plain_module():
    with ps_cluster(1, 2) as cluster:
        strategy = unison.ParameterServerStrategy(
            cluster.resolver(1, 2), variable_partitioner=unison.partitioners.FixedShardsPartitioner(3))
        coordinator = unison.ClusterCoordinator(strategy)
        with strategy.scope():
            embedding = nn.Embedding(10, 4, sparse=True)
            head = nn.Linear(4, 1)
            optimizer = torch.optim.SGD([*embedding.parameters(), *head.parameters()], lr=0.1)
        weight = embedding.weight
        assert isinstance(weight, unison.ShardedVariable)
        assert [tuple(v.shape) for v in weight.variables] == [(4, 4), (3, 4), (3, 4)]
        assert strategy.extended.variable_placement(weight) == [
            "/job:ps/replica:0/task:0", "/job:ps/replica:0/task:1", "/job:ps/replica:0/task:0"]
        # the head's weight is too small to shard: whole, and the next in the round-robin
        assert strategy.extended.variable_placement(head.weight) == "/job:ps/replica:0/task:1"
        before = weight.read_value()
        touched = torch.tensor([1, 2, 7])

        def step():
            ids = touched.repeat(4, 1)
            loss = head(embedding(ids).mean(1)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            rows_pulled = _rows_pulled()
            optimizer.step()
            return rows_pulled

        pulled = coordinator.fetch([coordinator.schedule(step) for _ in range(3)])
        assert pulled == [3, 3, 3]
        after = weight.read_value()
        untouched = [i for i in range(10) if i not in touched.tolist()]
        assert torch.equal(after[untouched], before[untouched])
        assert not torch.equal(after[touched], before[touched])
        plain = nn.Embedding(10, 4)
        plain.load_state_dict(embedding.state_dict())
        assert torch.equal(plain.weight.detach(), after)
        coordinator.shutdown()


def _buffers(module):
    return [b.detach().clone() for b in module.buffers()]


@pytest.mark.timeout(60)
def test_batchnorm_statistics_live_on_the_ps_and_every_workers_updates_add_up():
    # BatchNorm's buffers are ps variables: each function's change to them (its forward
    # pass's running-statistics update, its +1 batch) is added on the ps, whatever worker
    # ran it and however stale its pull was, so the coordinator reads the initial values
    # plus every function's change: the statistics of the data, and 40 batches.
    mu = torch.tensor([1.0, -2.0, 3.0])
    with ps_cluster(2, 1) as cluster:
        strategy = unison.ParameterServerStrategy(cluster.resolver(2, 1))
        coordinator = unison.ClusterCoordinator(strategy)
        with strategy.scope():
            model = nn.Sequential(nn.BatchNorm1d(3))  # its affine parameters train; the statistics follow the data
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        bn = model[0]
        assert strategy.extended.variable_placement(bn.running_mean) == "/job:ps/replica:0/task:0"
        initial = [v.clone() for v in model.state_dict().values()][2:]

        def step(seed):
            x = torch.randn(64, 3, generator=torch.Generator().manual_seed(seed)) * 2 + mu
            before = _buffers(model)
            loss = model(x).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            return _worker_index(), [after - b for after, b in zip(_buffers(model), before)]

        results = [coordinator.schedule(step, args=(i,)) for i in range(40)]
        coordinator.join()
        outcomes = [coordinator.fetch(r) for r in results]
        assert {worker for worker, _ in outcomes} == {0, 1}
        state = model.state_dict()
        assert state["0.num_batches_tracked"].item() == 40
        for k, name in enumerate(["0.running_mean", "0.running_var"]):
            changes = sum(change[k] for _, change in outcomes)
            torch.testing.assert_close(state[name], initial[k] + changes)  # every change arrived once
        # a worker's change from a stale pull still counts (TF's assign_add): near the data's
        # statistics, within the momentum of one stale first step (0.1 x |mu|) and the noise
        assert (state["0.running_mean"] - mu).abs().max().item() < 0.7, state["0.running_mean"]
        assert (state["0.running_var"] - 4.0).abs().max().item() < 1.2, state["0.running_var"]
        plain = nn.Sequential(nn.BatchNorm1d(3))
        plain.load_state_dict(state)
        coordinator.shutdown()
        assert cluster.stop() == {name: 0 for name in cluster.procs}


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before `optimizer.step\\(\\)`")
def test_a_scheduler_stepped_on_the_coordinator_trains_as_on_one_device():
    # The scheduler's "initial_lr" in the optimizer's groups reached the ps task as a
    # constructor argument of the optimizer: every push failed with a TypeError.
    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)

    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)) for _ in range(6)]
    with ps_cluster(1, 1) as cluster:
        strategy = unison.ParameterServerStrategy(cluster.resolver(1, 1))
        coordinator = unison.ClusterCoordinator(strategy)
        with strategy.scope():
            model, optimizer, scheduler = make()

        def step(x, y):
            optimizer.zero_grad()
            F.mse_loss(model(x), y).backward()
            optimizer.step()

        reference, ref_optimizer, ref_scheduler = make()
        for x, y in batches:  # one function at a time: the same steps as one device
            coordinator.schedule(step, args=(x, y))
            coordinator.join()
            scheduler.step()
            ref_optimizer.zero_grad()
            F.mse_loss(reference(x), y).backward()
            ref_optimizer.step()
            ref_scheduler.step()
        assert optimizer.param_groups[0]["lr"] == ref_optimizer.param_groups[0]["lr"] == 0.0125
        state = model.state_dict()
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(state[name], value, rtol=0, atol=1e-6)
        coordinator.shutdown()
        assert cluster.stop() == {name: 0 for name in cluster.procs}


@pytest.mark.timeout(60)
def test_the_optimizer_state_round_trips_through_a_checkpoint_as_on_one_device():
    # The moments live on the ps tasks; the coordinator's optimizer.state_dict() had no state,
    # so a resumed run restarted Adam's moments at zero.
    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(10, 8), nn.Flatten(), nn.Linear(16, 4))
        return model, torch.optim.Adam(model.parameters(), lr=0.05)

    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 10, (16, 2), generator=g), torch.randn(16, 4, generator=g)) for _ in range(6)]
    reference, ref_optimizer = make()

    def train(model, optimizer, x, y):
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()

    for x, y in batches[:3]:
        train(reference, ref_optimizer, x, y)
    checkpoint = copy.deepcopy({"model": reference.state_dict(), "optimizer": ref_optimizer.state_dict()})
    with ps_cluster(1, 2) as cluster:
        strategy = unison.ParameterServerStrategy(cluster.resolver(1, 2),
                                                  variable_partitioner=unison.partitioners.FixedShardsPartitioner(2))
        coordinator = unison.ClusterCoordinator(strategy)
        with strategy.scope():
            model, optimizer = make()
            with pytest.raises(UsageError, match="after the `with strategy.scope\\(\\):` block"):
                optimizer.load_state_dict(checkpoint["optimizer"])
        assert all(isinstance(p, unison.ShardedVariable) for p in model.parameters())  # state split over 2 ps
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])  # one device's moments onto the ps tasks
        for x, y in batches[3:]:
            coordinator.schedule(train, args=(model, optimizer, x, y))
            coordinator.join()
            train(reference, ref_optimizer, x, y)
        state = model.state_dict()
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(state[name], value, rtol=0, atol=1e-6)
        saved, expected = optimizer.state_dict(), ref_optimizer.state_dict()  # and back, for a plain optimizer
        assert saved["state"].keys() == expected["state"].keys() == {0, 1, 2}
        for index, entries in expected["state"].items():
            for name, value in entries.items():
                torch.testing.assert_close(saved["state"][index][name], value, rtol=0, atol=1e-6)
        coordinator.shutdown()
        assert cluster.stop() == {name: 0 for name in cluster.procs}
