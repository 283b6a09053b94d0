"""Real processes: user errors, a worker killed mid-training, a ps killed."""

import re
import signal
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import unison
from tests.ps._cluster import ps_cluster
from unison.errors import FunctionCancelledError, ParameterServerError


def _make(cluster, workers, ps, **kwargs):
    strategy = unison.ParameterServerStrategy(cluster.resolver(workers, ps), **kwargs)
    coordinator = unison.ClusterCoordinator(strategy)
    with strategy.scope():
        model = nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    return strategy, coordinator, model, optimizer


class _UserError(Exception):
    pass


@pytest.mark.timeout(60)
def test_user_error_type_traceback_cancellation_and_recovery():
    with ps_cluster(1, 1) as cluster:
        strategy, coordinator, model, optimizer = _make(cluster, 1, 1)

        def slow():
            time.sleep(0.5)  # keeps the queue full while the failure comes back
            return 1

        def failing():
            raise _UserError("bad input in step")

        first = coordinator.schedule(slow)
        bad = coordinator.schedule(failing)
        queued = [coordinator.schedule(slow) for _ in range(3)]
        with pytest.raises(_UserError, match="bad input") as info:
            coordinator.join()
        notes = "\n".join(getattr(info.value, "__notes__", []))
        assert "traceback on worker:0" in notes and "in failing" in notes
        assert first.fetch() == 1
        cancelled = 0
        for remote in queued:
            try:
                remote.fetch()
            except FunctionCancelledError as e:
                assert "reschedule" in str(e)
                cancelled += 1
        assert cancelled == 3
        with pytest.raises(_UserError):
            bad.fetch()
        coordinator.join()  # the error was raised once, then cleared
        assert coordinator.schedule(lambda: model.weight.sum() * 0 + 5).fetch() == 5
        coordinator.shutdown()


@pytest.mark.timeout(90)
def test_worker_killed_mid_training_then_back_is_reused():
    with ps_cluster(2, 1) as cluster:
        strategy, coordinator, model, optimizer = _make(cluster, 2, 1)
        w = torch.tensor([[1.0, -2.0, 3.0, 0.5]])

        def dataset_fn():
            x = torch.randn(1 << 15, 4)
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x @ w.T), batch_size=32)

        iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

        def step(it):
            from unison._ps.worker.runtime import RUNTIME

            time.sleep(0.02)
            x, y = next(it)
            loss = F.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            return RUNTIME.current.worker_index

        results = [coordinator.schedule(step, args=(iterator,)) for _ in range(60)]
        deadline = time.monotonic() + 30
        while sum(r.done() for r in results) < 10 and time.monotonic() < deadline:
            time.sleep(0.05)
        cluster.kill("worker:1")
        coordinator.join()
        assert all(r.done() for r in results)
        assert {r.fetch() for r in results} <= {0, 1}  # every function has a value
        # the worker comes back at its address: it is used again, its dataset rebuilt
        cluster.start("worker", 1, bind=cluster.addresses["worker:1"])
        cluster.wait_started()
        more = [coordinator.schedule(step, args=(iterator,)) for _ in range(80)]
        coordinator.join()
        assert 1 in {r.fetch() for r in more}
        coordinator.shutdown()
        codes = cluster.stop()
        assert codes["worker:0"] == 0 and codes["ps:0"] == 0


@pytest.mark.timeout(90)
def test_ps_killed_raises_error_naming_it_within_timeout():
    with ps_cluster(1, 2) as cluster:
        strategy, coordinator, model, optimizer = _make(cluster, 1, 2, timeout_seconds=5)
        value = coordinator.schedule(lambda: model(torch.ones(1, 4)).sum().item()).fetch()
        with torch.no_grad():  # the worker read the weight and the bias from their two ps tasks
            assert value == pytest.approx(model(torch.ones(1, 4)).sum().item(), rel=1e-6)
        cluster.kill("ps:1")
        start = time.monotonic()
        with pytest.raises(ParameterServerError, match=re.escape("ps:1")):
            for _ in range(1000):
                coordinator.schedule(lambda: model(torch.ones(1, 4)).sum().item())
                coordinator.join()
        assert time.monotonic() - start < 5 + 10
        coordinator.shutdown()
        # the killed ps says so; the others ended on the shutdown, not killed by the stop
        assert cluster.stop() == {"ps:0": 0, "ps:1": -signal.SIGKILL, "worker:0": 0}
