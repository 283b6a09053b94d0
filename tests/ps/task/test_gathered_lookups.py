"""A ps task's table shard gathers a synchronous job's training lookups of a global step: the
workers' lookups are made as one lookup of their ids together, with the rows, counts and slots
each would have got alone; a lookup whose partners do not come goes alone. A worker's table
asks every shard, so that no shard waits for a lookup that is not coming; a worker's lookup of
the ps task in its own process is posted, and taken after the other ps tasks' replies."""

from __future__ import annotations

import threading
from collections import Counter

import pytest
import torch

from unison._embeddings.optim.row_optimizers import RowAdagrad, RowSGD
from unison._embeddings.tables.id_hashing import shard_of
from unison._embeddings.tables.initializers import Uniform
from unison._embeddings.tables.local_table import LocalTable
from unison._embeddings.tables.table import TableConfig
from unison._ps.task import table_shards
from unison._ps.task.in_process_link import InProcessLink
from unison._ps.task.parameter_store import ParameterStore
from unison._ps.task.table_shards import TableShards
from unison._ps.wire import protocol as wire
from unison._ps.worker.remote_table import RemoteTable

pytestmark = pytest.mark.timeout(60)

DIM = 4
CONFIG = TableConfig(DIM, torch.float32, Uniform(-0.5, 0.5), 3, None)
ADAGRAD = RowAdagrad(lr=0.1)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of ids of each ``lookup_distinct`` call the shards make (one per lookup made)."""
    seen: list[int] = []
    original = LocalTable.lookup_distinct

    def counted(self, ids, occurrences):
        seen.append(ids.numel())
        return original(self, ids, occurrences)

    monkeypatch.setattr(LocalTable, "lookup_distinct", counted)
    return seen


def _shards() -> TableShards:
    shards = TableShards()
    shards.create("t", CONFIG)
    return shards


def _made(ids: torch.Tensor) -> torch.Tensor:
    """The rows a table makes for new ``ids``: its initializer's, from the ids alone."""
    return CONFIG.initializer(ids, DIM, CONFIG.seed, torch.float32)


def _in_thread(fn, *args, **kwargs) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run():
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def _waiting(shards: TableShards, step: int = 0) -> bool:
    with shards._entries["t"].lock:
        group = shards._entries["t"].gathering.get(step)
        return group is not None and any(ask is not None for ask in group.asks)


def _wait_until(condition, what: str) -> None:
    deadline = threading.Event()
    for _ in range(2000):
        if condition():
            return
        deadline.wait(0.005)
    raise AssertionError(f"timed out waiting until {what}")


def test_two_workers_lookups_of_a_step_are_made_as_one(calls):
    shards = _shards()
    mine, theirs = torch.tensor([1, 2, 3]), torch.tensor([3, 4])
    first, got = _in_thread(shards.rows, "t", theirs, torch.tensor([2, 1]), True, lookers=2)
    _wait_until(lambda: _waiting(shards), "the first lookup waits")
    rows = shards.rows("t", mine, torch.tensor([1, 1, 5]), True, lookers=2)
    first.join(10)
    assert "error" not in got
    assert calls == [4]  # one lookup of ids 1-4, not one per worker
    torch.testing.assert_close(rows, _made(mine))
    torch.testing.assert_close(got["value"], _made(theirs))
    export = shards.export("t")
    assert export["ids"].tolist() == [1, 2, 3, 4]
    assert export["counts"].tolist() == [1, 1, 5 + 2, 1]  # id 3: both workers' occurrences
    assert not shards._entries["t"].gathering


def test_each_worker_pushes_through_the_slots_its_part_of_the_lookup_found():
    # a lookup's slots are kept for the same session's push: the gathered lookup hands each its own
    shards = _shards()
    ids_a, ids_b = torch.tensor([7, 8]), torch.tensor([8, 9])
    grads_a, grads_b = torch.randn(2, DIM), torch.randn(2, DIM)

    def worker(ids, grads):
        shards.rows("t", ids, torch.ones_like(ids), True, lookers=2)
        shards.push("t", ids, grads, ADAGRAD, at_step=1, pushers=2)

    other, out = _in_thread(worker, ids_b, grads_b)
    _wait_until(lambda: _waiting(shards), "worker b's lookup waits")
    worker(ids_a, grads_a)
    other.join(10)
    assert "error" not in out
    every = torch.tensor([7, 8, 9])
    weight = torch.nn.Parameter(_made(every))
    opt = torch.optim.Adagrad([weight], lr=ADAGRAD.lr)
    index = torch.tensor([[0, 1, 1, 2]])
    weight.grad = torch.sparse_coo_tensor(index, torch.cat([grads_a, grads_b]), (3, DIM), check_invariants=True)
    opt.step()
    torch.testing.assert_close(shards.rows("t", every, torch.ones(3, dtype=torch.int64), False), weight.detach())


def test_a_lookup_whose_partners_never_come_goes_alone_and_gathering_pauses_after_a_few(calls, monkeypatch):
    monkeypatch.setattr(table_shards, "_GATHER_S", 0.05)
    shards = _shards()
    entry = shards._entries["t"]
    ids = torch.tensor([5, 6])
    misses = table_shards._GATHER_MISSES_OFF
    for _ in range(misses):  # ten workers' lookups expected; only these come, one at a time
        rows = shards.rows("t", ids, torch.ones_like(ids), True, lookers=10)
        torch.testing.assert_close(rows, _made(ids))
    assert calls == [2] * misses
    assert entry.gather_paused == table_shards._GATHER_PAUSE and entry.gather_misses == 0
    shards.rows("t", ids, torch.ones_like(ids), True, lookers=10)  # alone, without waiting
    assert entry.gather_paused == table_shards._GATHER_PAUSE - 1 and entry.gather_misses == 0
    assert entry.gathering[0].came == misses  # a paused shard does not gather


def test_a_lookup_together_that_fails_lets_each_worker_meet_its_own_error(calls):
    shards = _shards()
    good, bad = torch.tensor([1, 2]), torch.tensor([3.0, 4.0])  # float ids: the table refuses them
    waiting, got = _in_thread(shards.rows, "t", good, torch.ones(2, dtype=torch.int64), True, lookers=2)
    _wait_until(lambda: _waiting(shards), "the good lookup waits")
    with pytest.raises(TypeError, match="int64 ids"):  # its own error, from its lookup alone
        shards.rows("t", bad, torch.ones(2, dtype=torch.int64), True, lookers=2)
    waiting.join(10)
    assert "error" not in got, got.get("error")
    torch.testing.assert_close(got["value"], _made(good))
    assert Counter(shards.export("t")["ids"].tolist()) == Counter([1, 2])


def test_an_evaluation_lookup_is_never_gathered(calls):
    shards = _shards()
    ids = torch.tensor([1, 2])
    shards.rows("t", ids, torch.ones_like(ids), True)
    calls.clear()
    rows = shards.rows("t", ids, torch.ones_like(ids), False, lookers=2)  # create=False: evaluation
    torch.testing.assert_close(rows, _made(ids))
    assert not shards._entries["t"].gathering


class _RecordingClient:
    """A PSClient stand-in that answers lookups with zero rows and records what was asked."""

    def __init__(self) -> None:
        self.calls: list[tuple[dict, bool]] = []

    def exchange(self, requests, *, wait=True, gathered=False):
        self.calls.append(({k: (header, [t.clone() for t in tensors]) for k, (header, tensors, _) in requests.items()},
                           gathered))
        return {k: [torch.zeros(tensors[0].numel(), DIM)] for k, (_, tensors, _) in requests.items()}


def test_a_synchronous_training_lookup_asks_every_shard_and_an_evaluation_one_only_those_it_needs():
    client = _RecordingClient()
    table = RemoteTable("t", 2, CONFIG, lambda: client, synchronous=True, pushers=3)
    candidates = torch.arange(100)
    on_zero = candidates[shard_of(candidates, 2) == 0][:3]  # ids that all live on shard 0
    table.lookup(on_zero)
    asked, gathered = client.calls[-1]
    assert sorted(asked) == [0, 1] and gathered  # shard 1 too, with no ids: its other workers' lookups wait
    assert all(header.lookers == 3 for header, _ in asked.values())
    assert asked[1][1][0].numel() == 0 and torch.equal(asked[0][1][0], on_zero)
    table.lookup(on_zero, create=False)
    asked, gathered = client.calls[-1]
    assert sorted(asked) == [0] and not gathered and asked[0][0].lookers == 1
    alone = RemoteTable("u", 2, CONFIG, lambda: client)  # asynchronous: lookups are never gathered
    alone.lookup(on_zero)
    asked, gathered = client.calls[-1]
    assert sorted(asked) == [0] and not gathered and asked[0][0].lookers == 1


def test_a_lookup_posted_before_the_others_come_is_looked_up_with_theirs_and_taken_after(calls):
    # a worker that serves this ps task in its own process posts its lookup, waits for the other
    # ps tasks' replies, then takes it; meanwhile another worker's lookup came and took it along
    shards = _shards()
    mine, theirs = torch.tensor([1, 2]), torch.tensor([2, 3])
    posted = shards.post_rows("t", mine, torch.tensor([1, 4]), 0, 1.0, 2)
    assert calls == []  # posted: nothing looked up yet
    rows = shards.rows("t", theirs, torch.tensor([1, 1]), True, lookers=2)  # the step's last: both, at once
    assert calls == [3]
    torch.testing.assert_close(rows, _made(theirs))
    torch.testing.assert_close(shards.take_rows(posted), _made(mine))
    assert calls == [3]
    assert shards.export("t")["counts"].tolist() == [1, 4 + 1, 1]


def test_a_lookup_posted_last_looks_up_the_waiting_ones_at_once(calls):
    shards = _shards()
    mine, theirs = torch.tensor([4]), torch.tensor([4, 5])
    waiting, got = _in_thread(shards.rows, "t", theirs, torch.ones(2, dtype=torch.int64), True, lookers=2)
    _wait_until(lambda: _waiting(shards), "the other worker's lookup waits")
    posted = shards.post_rows("t", mine, torch.ones(1, dtype=torch.int64), 0, 1.0, 2)
    waiting.join(10)
    assert calls == [2]
    torch.testing.assert_close(got["value"], _made(theirs))
    torch.testing.assert_close(shards.take_rows(posted), _made(mine))
    assert calls == [2]


def test_a_posted_lookup_whose_partner_is_late_is_taken_alone_and_the_partner_does_not_wait(calls):
    shards = _shards()
    mine, theirs = torch.tensor([1]), torch.tensor([2])
    posted = shards.post_rows("t", mine, torch.ones(1, dtype=torch.int64), 0, 1.0, 2)
    torch.testing.assert_close(shards.take_rows(posted), _made(mine))  # the other's has not come
    shards.rows("t", theirs, torch.ones(1, dtype=torch.int64), True, lookers=2)  # the last: alone, no wait
    assert calls == [1, 1]
    entry = shards._entries["t"]
    assert entry.gather_misses == 0 and not entry.gathering


def test_the_in_process_link_posts_a_gathered_lookup_at_send_and_takes_it_at_recv(calls):
    store = ParameterStore()
    link = InProcessLink(store, "ps:0")
    link.request(wire.TableCreate("t", CONFIG))
    mine, theirs = torch.tensor([1, 2]), torch.tensor([2, 3])
    link.send(wire.TableRows("t", True, 0, 1.0, 2), [mine, torch.ones(2, dtype=torch.int64)])
    assert calls == []
    store.tables.rows("t", theirs, torch.ones(2, dtype=torch.int64), True, lookers=2)  # another worker's
    header, (rows,) = link.recv()
    assert isinstance(header, wire.Ok) and calls == [3]
    torch.testing.assert_close(rows, _made(mine))
    # a push that failed is still reported at the next request with a reply, which is not applied
    link.send(wire.TablePush("t", RowSGD(lr=1.0), None), [torch.tensor([1]), torch.ones(3, 4)])  # bad shapes
    link.send(wire.TableRows("t", True, 0, 1.0, 2), [torch.tensor([7]), torch.ones(1, dtype=torch.int64)])
    header, _ = link.recv()
    assert isinstance(header, wire.Failed) and header.earlier
    assert 7 not in store.tables.export("t")["ids"].tolist()


def test_a_load_drops_the_lookups_gathered_before_it(calls):
    # a lookup posted and never taken (its request failed on another ps task) must not be counted
    # again by a lookup of the same step number after a restore
    shards = _shards()
    ids = torch.tensor([1, 2])
    shards.rows("t", ids, torch.ones_like(ids), True)
    export = shards.export("t")
    shards.post_rows("t", ids, torch.tensor([5, 5]), 0, 1.0, 2)  # never taken
    shards.load("t", export, 0, 1)
    calls.clear()
    shards.post_rows("t", ids, torch.ones_like(ids), 0, 1.0, 2)
    assert calls == [] and shards._entries["t"].gathering[0].came == 1
    assert shards.export("t")["counts"].tolist() == export["counts"].tolist()
