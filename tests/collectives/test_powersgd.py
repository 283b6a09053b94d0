"""PowerSGD's algorithm in one process (the all-reduce of one worker is the identity)."""

from __future__ import annotations

import pytest
import torch

import unison
from unison.collectives.powersgd import PowerSGDReducer


def _one_worker(config: unison.PowerSGD) -> PowerSGDReducer:
    return PowerSGDReducer(config, lambda tensors: [t.clone() for t in tensors])


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
        owed = reducer._errors[0]
        torch.testing.assert_close(applied + owed, truth, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(applied, truth, atol=1e-2)  # rank 1 of a random 32 x 24: it did compress


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


@pytest.mark.parametrize("field, value", [("rank", 0), ("start_iter", -1), ("min_compression_rate", 0.5)])
def test_bad_arguments_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"PowerSGD.{field}"):
        unison.PowerSGD(**{field: value})
