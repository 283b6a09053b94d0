"""A worker's pulls and pushes against in-process ps tasks (no coordinator)."""

import secrets

import pytest
import torch
import torch.nn.functional as F

import unison
from unison._ps.remote_variables.variable_specs import Placement, VariableSpec
from unison._ps.wire import protocol as wire
from unison._ps.wire.client import PSClient
from unison._ps.worker.runtime import LAZY_BYTES, WorkerRuntime, WorkerShardedParameter


def _client(shared):
    key = secrets.token_bytes(32)
    servers = [unison.Server({"ps": ["127.0.0.1:1", "127.0.0.1:2"]}, "ps", i, authkey=key, bind_address="127.0.0.1:0")
               for i in range(2)]
    client = PSClient([s.address for s in servers], key, shared=shared)
    yield client
    client.close()
    for server in servers:
        server.stop()


@pytest.fixture(params=[False, True], ids=["sockets", "shared"])
def client(request):
    """A client over sockets only, and a worker's client with a shared-memory arena."""
    yield from _client(request.param)


@pytest.fixture
def shared_client():
    yield from _client(True)


def _spec(name, shape, parts):
    return VariableSpec(name, shape, torch.float32, True, tuple(parts), len(parts) > 1)


@pytest.mark.timeout(30)
def test_large_whole_variable_moves_only_looked_up_rows(client):
    rows = LAZY_BYTES // (64 * 4)  # exactly LAZY_BYTES: pulled lazily, by rows
    table = torch.randn(rows, 64)
    spec = _spec("table", (rows, 64), [Placement(1, "t", rows)])
    client.write(wire.Create, [(1, "t")], [table])
    runtime = WorkerRuntime(client, 0)
    runtime.begin()
    weight = runtime.variable(spec)
    assert isinstance(weight, WorkerShardedParameter)
    runtime.pull_touched()  # nothing whole to pull
    ids = torch.tensor([[3, 5], [5, 9]])
    out = F.embedding(ids, weight, sparse=True)
    assert [r.shape[0] for _, _, r in runtime._rows] == [3]
    torch.testing.assert_close(out, table[ids])
    out.sum().backward()
    optimizer = torch.optim.SGD([weight], lr=0.5)
    runtime.push(optimizer)
    after = client.read([(1, "t")])[0]
    expected = table.clone()
    expected[3] -= 0.5
    expected[5] -= 1.0  # looked up twice
    expected[9] -= 0.5
    torch.testing.assert_close(after, expected)


@pytest.mark.timeout(30)
def test_dense_pull_into_parameters_and_momentum_state_on_ps(client):
    w0 = torch.randn(3, 2)
    client.write(wire.Create, [(0, "w")], [w0])
    runtime = WorkerRuntime(client, 0)
    spec = _spec("w", (3, 2), [Placement(0, "w", 3)])
    local = w0.clone().requires_grad_(True)
    reference = torch.optim.SGD([local], lr=0.1, momentum=0.9)
    for _ in range(3):
        runtime.begin()
        w = runtime.variable(spec)
        runtime.pull_touched()
        torch.testing.assert_close(w.detach(), local.detach())
        optimizer = torch.optim.SGD([w], lr=0.1, momentum=0.9)  # a fresh copy each time, as unpickled
        (w * w).sum().backward()
        optimizer.step()
        assert w.grad is None and not optimizer.state  # the update ran on the ps task
        (local * local).sum().backward()
        reference.step()
        reference.zero_grad()
    torch.testing.assert_close(client.read([(0, "w")])[0], local.detach())


def _train_dense(client, steps=3):
    """Three SGD-momentum steps of a worker on ``w`` (ps:0); returns the local reference result."""
    w0 = torch.randn(3, 2)
    client.write(wire.Create, [(0, "w")], [w0])
    runtime = WorkerRuntime(client, 0)
    spec = _spec("w", (3, 2), [Placement(0, "w", 3)])
    local = w0.clone().requires_grad_(True)
    reference = torch.optim.SGD([local], lr=0.1)
    for _ in range(steps):
        runtime.begin()
        w = runtime.variable(spec)
        runtime.pull_touched()
        torch.testing.assert_close(w.detach(), local.detach())
        (w * w).sum().backward()
        torch.optim.SGD([w], lr=0.1).step()
        (local * local).sum().backward()
        reference.step()
        reference.zero_grad()
    return runtime, local


@pytest.mark.timeout(30)
def test_same_host_worker_moves_dense_values_through_shared_memory(shared_client):
    client = shared_client
    runtime, local = _train_dense(client)
    w = runtime._cache["w"]
    assert client.arena.place(w.detach()) is not None  # the cached parameter lives in the arena
    assert client._attached[0]  # ps:0 mapped the arena: pulls and pushes named places in it
    torch.testing.assert_close(client.read([(0, "w")])[0], local.detach())


@pytest.mark.timeout(30)
def test_worker_falls_back_to_sockets_when_the_ps_cannot_map_its_memory(shared_client, monkeypatch):
    client = shared_client
    from unison._ps.wire.shared_arena import MappedSegments

    monkeypatch.setattr(MappedSegments, "attach", lambda self, infos: False)  # as a ps on another host
    runtime, local = _train_dense(client)
    assert client._attached[0] is None
    torch.testing.assert_close(client.read([(0, "w")])[0], local.detach())


def test_mapping_checks_the_segment_token():
    from unison._ps.wire.shared_arena import MappedSegments, SharedArena

    arena = SharedArena()
    t = arena.tensor((4,), torch.float32)
    t.copy_(torch.arange(4.0))
    token, pid, fd, size = arena.segments()[0]
    mapped = MappedSegments()
    try:
        assert not mapped.attach([("00" * 16, pid, fd, size)])  # another process behind the same pid and fd
        assert not mapped.attach([(token, pid, 10**6, size)])  # no such descriptor
        assert mapped.attach([(token, pid, fd, size)])
        torch.testing.assert_close(mapped.tensor(arena.place(t)), torch.arange(4.0))
        with pytest.raises(ValueError):
            mapped.tensor((token, size, (4,), torch.float32))
    finally:
        mapped.close()
        del t
        arena.close()


@pytest.mark.timeout(30)
def test_changes_to_non_trainable_variables_reach_the_ps_as_added_differences(client, monkeypatch):
    # Two workers pull the same BatchNorm-like statistics and a batch counter, each changes
    # them in place; both changes add up on the ps. A bool is assigned; unchanged ones move nothing.
    mean0, count0 = torch.tensor([1.0, 2.0]), torch.tensor(5)
    client.write(wire.Create, [(0, "mean"), (1, "count"), (0, "flag"), (1, "same")],
                 [mean0, count0, torch.tensor([False, False]), torch.ones(3)])
    specs = [VariableSpec("mean", (2,), torch.float32, False, (Placement(0, "mean", 2),), False),
             VariableSpec("count", (), torch.int64, False, (Placement(1, "count", 1),), False),
             VariableSpec("flag", (2,), torch.bool, False, (Placement(0, "flag", 2),), False),
             VariableSpec("same", (3,), torch.float32, False, (Placement(1, "same", 3),), False)]
    writes = []
    original = client.write
    monkeypatch.setattr(client, "write", lambda kind, placed, values: writes.append((kind, placed)) or
                        original(kind, placed, values))
    workers = [WorkerRuntime(client, i) for i in range(2)]
    pulled = []
    for runtime in workers:
        runtime.begin()
        pulled.append([runtime.variable(spec) for spec in specs])
        runtime.pull_touched()
    for (mean, count, flag, _), shift in zip(pulled, (0.5, 0.25)):
        with torch.no_grad():
            mean.mul_(0.9).add_(shift)  # what batch_norm does to running_mean
            count.add_(1)
            flag[0] = True
    for runtime in workers:
        runtime.push_changes()
        runtime.end()
    mean, count, flag, same = client.read([(0, "mean"), (1, "count"), (0, "flag"), (1, "same")])
    torch.testing.assert_close(mean, mean0 + (mean0 * 0.9 + 0.5 - mean0) + (mean0 * 0.9 + 0.25 - mean0))
    assert count.item() == 7 and count.dtype == torch.int64
    assert flag.tolist() == [True, False]
    torch.testing.assert_close(same, torch.ones(3))
    assert writes == [(wire.Add, [(0, "mean"), (1, "count")]), (wire.Assign, [(0, "flag")])] * 2
