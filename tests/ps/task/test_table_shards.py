"""A ps task's table shards under a synchronous job (the hybrid strategy): every worker's push of a
global step is held until all have come and applied once, summed, and a lookup naming the steps its
worker pushed waits until they are applied."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from unison._embeddings.optim.row_optimizers import RowAdagrad
from unison._embeddings.tables.initializers import Uniform
from unison._embeddings.tables.table import TableConfig
from unison._ps.task.table_shards import TableShards

DIM = 4
CONFIG = TableConfig(DIM, torch.float32, Uniform(-0.5, 0.5), 3, None)
ADAGRAD = RowAdagrad(lr=0.1)


def _shards_with_rows(ids: torch.Tensor) -> TableShards:
    shards = TableShards()
    shards.create("t", CONFIG)
    shards.rows("t", ids, torch.ones_like(ids), True)
    return shards


def _rows(shards: TableShards, ids: torch.Tensor) -> torch.Tensor:
    return shards.rows("t", ids, torch.ones_like(ids), False)


def _torch_adagrad(ids: torch.Tensor, start: torch.Tensor, *steps: list[tuple[torch.Tensor, torch.Tensor]]):
    """Plain ``torch.optim.Adagrad`` on sparse gradients, from ``start`` (the rows of ``ids``): one step per
    entry of ``steps``, its pushes' gradients summed (a sparse gradient is coalesced)."""
    weight = torch.nn.Parameter(start.clone())
    opt = torch.optim.Adagrad([weight], lr=ADAGRAD.lr)
    where = {int(i): k for k, i in enumerate(ids)}
    for pushes in steps:
        index = torch.tensor([[where[int(i)] for p_ids, _ in pushes for i in p_ids]])
        weight.grad = torch.sparse_coo_tensor(index, torch.cat([g for _, g in pushes]), tuple(start.shape),
                                              check_invariants=True)
        opt.step()
    return weight.detach()


def test_two_workers_pushes_of_a_step_are_applied_once_with_their_sum():
    ids = torch.tensor([1, 2, 3, 4])
    shards = _shards_with_rows(ids)
    before = _rows(shards, ids)
    mine, theirs = (torch.tensor([1, 2, 3]), torch.randn(3, DIM)), (torch.tensor([3, 4]), torch.randn(2, DIM))
    shards.push("t", *mine, ADAGRAD, at_step=1, pushers=2)
    assert torch.equal(_rows(shards, ids), before)  # held: the other worker's push of step 1 has not come
    shards.push("t", *theirs, ADAGRAD, at_step=1, pushers=2)
    # row 3, which both pushed, took one Adagrad step with the summed gradient (two steps would differ)
    torch.testing.assert_close(_rows(shards, ids), _torch_adagrad(ids, before, [mine, theirs]))
    assert shards._entries["t"].table.current_step == 1 and not shards._entries["t"].pending


def test_a_push_through_the_slots_its_lookup_found_sums_the_same():
    # the fast path: each session's push reuses the slots its lookup found (one session here, then another)
    ids_a, ids_b = torch.tensor([7, 8]), torch.tensor([8, 9])
    shards = TableShards()
    shards.create("t", CONFIG)
    grads_a, grads_b = torch.randn(2, DIM), torch.randn(2, DIM)
    results = {}

    def worker(name, ids, grads):
        shards.rows("t", ids, torch.ones_like(ids), True)
        shards.push("t", ids, grads, ADAGRAD, at_step=1, pushers=2)
        results[name] = True

    every = torch.tensor([7, 8, 9])
    start = CONFIG.initializer(every, DIM, CONFIG.seed, torch.float32)  # the rows the lookups make
    first = threading.Thread(target=worker, args=("a", ids_a, grads_a))
    first.start()
    first.join()
    worker("b", ids_b, grads_b)
    torch.testing.assert_close(_rows(shards, every), _torch_adagrad(every, start, [(ids_a, grads_a), (ids_b, grads_b)]))


def test_a_held_push_keeps_its_own_copy_of_the_tensors_it_came_in():
    # a socket session receives the next request into the same buffers
    ids = torch.tensor([1, 2])
    shards = _shards_with_rows(ids)
    before = _rows(shards, ids)
    buffer_ids, buffer_grads = ids.clone(), torch.ones(2, DIM)
    shards.push("t", buffer_ids, buffer_grads, ADAGRAD, at_step=1, pushers=2)
    buffer_ids.fill_(99)
    buffer_grads.fill_(-5.0)
    shards.push("t", ids, torch.ones(2, DIM), ADAGRAD, at_step=1, pushers=2)
    both = [(ids, torch.ones(2, DIM)), (ids, torch.ones(2, DIM))]
    torch.testing.assert_close(_rows(shards, ids), _torch_adagrad(ids, before, both))


def test_steps_are_applied_in_order_whichever_push_comes_first():
    ids = torch.tensor([5])
    shards = _shards_with_rows(ids)
    before = _rows(shards, ids)
    one, two = torch.full((1, DIM), 0.5), torch.full((1, DIM), -2.0)
    shards.push("t", ids, one, ADAGRAD, at_step=1, pushers=2)
    shards.push("t", ids, two, ADAGRAD, at_step=2, pushers=2)  # worker 0 is a step ahead
    shards.push("t", ids, two, ADAGRAD, at_step=2, pushers=2)  # step 2 complete, step 1 not yet: held
    assert shards._entries["t"].table.current_step == 0
    shards.push("t", ids, one, ADAGRAD, at_step=1, pushers=2)  # step 1, then step 2
    expected = _torch_adagrad(ids, before, [(ids, one), (ids, one)], [(ids, two), (ids, two)])
    torch.testing.assert_close(_rows(shards, ids), expected)
    assert shards._entries["t"].table.current_step == 2


def test_a_lookup_waits_until_the_steps_its_worker_pushed_are_applied():
    ids = torch.tensor([1, 2])
    shards = _shards_with_rows(ids)
    before = _rows(shards, ids)
    grads = torch.ones(2, DIM)
    shards.push("t", ids, grads, ADAGRAD, at_step=1, pushers=2)
    got = {}

    def lookup():
        got["rows"] = shards.rows("t", ids, torch.ones_like(ids), True, after_step=1, wait_s=30.0)

    waiting = threading.Thread(target=lookup)
    waiting.start()
    time.sleep(0.2)
    assert waiting.is_alive()  # the other worker's push of step 1 has not come
    shards.push("t", ids, grads, ADAGRAD, at_step=1, pushers=2)
    waiting.join(10)
    assert not waiting.is_alive()
    torch.testing.assert_close(got["rows"], _torch_adagrad(ids, before, [(ids, grads), (ids, grads)]))


def test_a_lookup_whose_step_never_completes_names_it_and_the_pushes_that_came():
    ids = torch.tensor([1])
    shards = _shards_with_rows(ids)
    shards.push("t", ids, torch.ones(1, DIM), ADAGRAD, at_step=1, pushers=3)
    with pytest.raises(TimeoutError, match=r"waited 0.2 s for global step 1 .* only step 0 is: 1 worker\(s\) pushed "
                                           r"step 1 so far.*push once per global step"):
        shards.rows("t", ids, torch.ones_like(ids), True, after_step=1, wait_s=0.2)
    with pytest.raises(TimeoutError, match="global step 1"):  # a pooled lookup waits the same way
        shards.pool("t", ids, torch.tensor([0]), torch.ones(1), 1, True, after_step=1, wait_s=0.1)


def test_a_push_of_a_step_the_clock_passed_is_applied_as_it_comes():
    # workers restarted without a checkpoint count from step 1 again, on shards whose clock went on
    ids = torch.tensor([1])
    shards = _shards_with_rows(ids)
    for step in (1, 2):
        for _ in range(2):
            shards.push("t", ids, torch.ones(1, DIM), ADAGRAD, at_step=step, pushers=2)
    before = _rows(shards, ids)
    shards.push("t", ids, torch.ones(1, DIM), ADAGRAD, at_step=1, pushers=2)
    assert not torch.equal(_rows(shards, ids), before) and not shards._entries["t"].pending
    assert shards.rows("t", ids, torch.ones_like(ids), False, after_step=1, wait_s=0.0).shape == (1, DIM)


def test_a_load_drops_the_pushes_held_for_steps_after_it():
    ids = torch.tensor([1, 2])
    shards = _shards_with_rows(ids)
    export = shards.export("t")
    shards.push("t", ids, torch.ones(2, DIM), ADAGRAD, at_step=1, pushers=2)
    shards.load("t", export, 0, 1)
    assert not shards._entries["t"].pending
    torch.testing.assert_close(_rows(shards, ids), export["rows"])


def test_a_step_whose_sum_fails_to_apply_fails_the_lookups_waiting_for_it_at_once():
    ids = torch.tensor([1, 2])
    shards = _shards_with_rows(ids)
    shards.push("t", ids, torch.ones(2, DIM + 1), ADAGRAD, at_step=1, pushers=2)  # a malformed push, held
    with pytest.raises(RuntimeError):  # the push that completes the step raises the sum's error
        shards.push("t", ids, torch.ones(2, DIM), ADAGRAD, at_step=1, pushers=2)
    # a RuntimeError naming the failed step, not the TimeoutError the 30 s wait would end in
    with pytest.raises(RuntimeError, match=r"pushes of global step 1 failed to apply on this ps task .*global step 1 "
                                           r"never will"):
        shards.rows("t", ids, torch.ones_like(ids), True, after_step=1, wait_s=30.0)
