"""PowerSGD's algorithm in one process: one worker (its all-reduce is the identity), and
several workers as threads whose all-reduce sums their lists."""

from __future__ import annotations

import threading

import pytest
import torch

import unison
from unison._collectives.transport.powersgd import PowerSGDReducer


def _one_worker(config: unison.PowerSGD) -> PowerSGDReducer:
    return PowerSGDReducer(config, lambda tensors: [t.clone() for t in tensors], 1)


class _ThreadAllReduce:
    """A sum across ``workers`` threads: each calls with its list, each gets the sums."""

    def __init__(self, workers: int):
        self._barrier = threading.Barrier(workers, timeout=10)
        self._inputs: dict[int, list[torch.Tensor]] = {}
        self._sums: list[torch.Tensor] = []

    def for_worker(self, rank: int):
        def all_reduce(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
            self._inputs[rank] = [t.clone() for t in tensors]
            if self._barrier.wait() == 0:
                self._sums = [sum(parts) for parts in zip(*self._inputs.values())]
            self._barrier.wait()
            sums = [t.clone() for t in self._sums]
            self._barrier.wait()  # nobody overwrites the sums before everyone has them
            return sums
        return all_reduce


def test_error_feedback_makes_the_applied_updates_add_up_to_the_true_gradients():
    """Sum of what was applied + what is still owed == sum of the true gradients, every step."""
    reducer = _one_worker(unison.PowerSGD(rank=1, start_iter=0))
    g = torch.Generator().manual_seed(0)
    truth, applied = torch.zeros(32, 24), torch.zeros(32, 24)
    for _ in range(30):
        grad = torch.randn(32, 24, generator=g)
        truth += grad
        sent = grad.clone()
        reducer.reduce([sent], 1)
        applied += sent
        owed = reducer.owed(0)
        torch.testing.assert_close(applied + owed, truth, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(applied, truth, atol=1e-2)  # rank 1 of a random 32 x 24: it did compress


@pytest.mark.parametrize("mean", [True, False])
def test_with_several_workers_the_errors_add_up_to_what_the_updates_missed(mean):
    """Over 3 workers: applied updates + every worker's owed error == the true mean (or sum), every step.

    The approximation stands for the workers' total, so each worker owes its own part
    less a third of it; owing the whole approximation (as a one-worker view would) makes
    the errors push against the gradients.
    """
    workers, steps = 3, 25
    fabric = _ThreadAllReduce(workers)
    reducers = [PowerSGDReducer(unison.PowerSGD(rank=1, start_iter=0), fabric.for_worker(r), workers)
                for r in range(workers)]
    g = torch.Generator().manual_seed(2)
    grads = [[torch.randn(24, 16, generator=g) for _ in range(workers)] for _ in range(steps)]
    divisor = workers if mean else 1
    applied: list[list[torch.Tensor]] = [[] for _ in range(workers)]
    owed: list[list[torch.Tensor]] = [[] for _ in range(workers)]

    def work(rank: int) -> None:
        for step in range(steps):
            sent = grads[step][rank].clone()
            reducers[rank].reduce([sent], divisor)
            applied[rank].append(sent)
            owed[rank].append(reducers[rank].owed(0).clone())

    threads = [threading.Thread(target=work, args=(r,)) for r in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    truth = torch.zeros(24, 16)
    total_applied = torch.zeros(24, 16)
    for step in range(steps):
        truth += sum(grads[step]) / divisor
        total_applied += applied[0][step]
        for rank in range(1, workers):
            assert torch.equal(applied[rank][step], applied[0][step])  # every worker applies the same update
        total_owed = sum(owed[rank][step] for rank in range(workers))
        torch.testing.assert_close(total_applied + total_owed, truth, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(total_applied, truth, atol=1e-2)  # it did compress


def test_a_low_rank_gradient_is_recovered_once_q_is_warm():
    reducer = _one_worker(unison.PowerSGD(rank=2, start_iter=0))
    g = torch.Generator().manual_seed(1)
    grad = torch.randn(40, 2, generator=g) @ torch.randn(2, 30, generator=g)  # rank 2
    for _ in range(3):
        sent = grad.clone()
        reducer.reduce([sent], 1)
    torch.testing.assert_close(sent, grad, rtol=1e-4, atol=1e-4)


def test_vectors_small_matrices_and_the_first_steps_are_exact():
    reducer = _one_worker(unison.PowerSGD(rank=1, start_iter=2))
    bias, small, big = torch.randn(10), torch.randn(2, 2), torch.randn(50, 50)
    for step in range(3):
        grads = [bias.clone(), small.clone(), big.clone()]
        reducer.reduce(grads, 2)
        assert torch.equal(grads[0], bias / 2) and torch.equal(grads[1], small / 2)
        assert torch.equal(grads[2], big / 2) == (step < 2)


def test_same_shaped_gradients_go_together_and_each_keeps_its_own_error():
    """Gradients of one shape go through PowerSGD as one batch (issue 45): each is what it
    would be alone (the same seeded Q, the same steps), and its error stays its own."""
    config = unison.PowerSGD(rank=2, start_iter=0)
    g = torch.Generator().manual_seed(3)
    steps = [[torch.randn(24, 16, generator=g), torch.randn(7, generator=g), torch.randn(24, 16, generator=g),
              torch.randn(30, 12, generator=g)] for _ in range(4)]
    together = _one_worker(config)
    alone = {index: _one_worker(config) for index in (0, 2, 3)}
    for grads in steps:
        sent = [t.clone() for t in grads]
        together.reduce(sent, 2)
        for index, reducer in alone.items():
            # alone: the same index (its seed), beside an exact vector in the other places
            own = [grads[index].clone() if i == index else torch.zeros(3) for i in range(4)]
            reducer.reduce(own, 2)
            torch.testing.assert_close(sent[index], own[index], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(together.owed(index), reducer.owed(index), rtol=1e-5, atol=1e-6)
        assert torch.equal(sent[1], grads[1] / 2)
    assert together.owed(1) is None  # a vector: exact, nothing owed


@pytest.mark.parametrize("field, value", [("rank", 0), ("start_iter", -1), ("min_compression_rate", 0.5)])
def test_bad_arguments_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"PowerSGD.{field}"):
        unison.PowerSGD(**{field: value})
