"""Hierarchical all-reduce: shared memory within each host, gloo between the hosts (per slice, or by leaders)
(issue 15)."""

from __future__ import annotations

import pytest
import torch

from tests.collectives.transport import _hierarchical_workers as h
from tests.multi_worker import _workers as w
from unison._testing import run_workers


@pytest.mark.timeout(120)
@pytest.mark.parametrize("hosts, across", [(h.HOSTS, "columns"), (h.UNEQUAL_HOSTS, "leaders")],
                         ids=["2x2-columns", "2+1-leaders"])
def test_batches_over_two_hosts_sum_like_a_plain_sum(hosts, across):
    world = len(hosts)
    results = run_workers(h.reduce_batches, world, args=("AUTO", hosts), timeout=100)
    inputs = [h.batch_of(rank) for rank in range(world)]
    for result in results:
        assert result["hierarchical"] and result["shared"]
        assert result["across_hosts"] == across
        for i, got in enumerate(result["sums"]):
            want = sum(batch[i] for batch in inputs)
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        for i, got in enumerate(result["means"]):
            want = sum(batch[i] for batch in inputs) / world
            torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-6, atol=1e-6)
    for result in results[1:]:  # every worker gets the very same numbers
        assert all(torch.equal(a, b) for a, b in zip(result["sums"], results[0]["sums"]))


@pytest.mark.timeout(150)
@pytest.mark.parametrize("implementation", ["AUTO", "RING"])
def test_training_on_two_hosts_matches_single_device(implementation):
    # one worker's probe of the link between hosts reads it slow: every worker takes the small buckets
    results = run_workers(h.train, 4, args=(implementation, 3), timeout=130)
    reference = w.single_device_weights(2, 16)
    if implementation == "AUTO":
        assert [result["bucket_bytes"] for result in results] == [512 * 1024] * 4  # the slowest links' size
    for result in results:
        assert result["hierarchical"] is (implementation == "AUTO")
        assert result["buckets"] == [implementation == "AUTO"] * len(result["buckets"])
        for got, want in zip(result["weights"], reference):
            assert (got - want).abs().max().item() <= 1e-5


@pytest.mark.timeout(150)
@pytest.mark.parametrize("out_of_order", [False, True], ids=["made-in-forward-order", "made-out-of-order"])
def test_buckets_cross_hosts_during_backward_and_training_still_matches_single_device(out_of_order, tmp_path):
    """Equal hosts: each bucket's trip between hosts starts as soon as the host wrote it, while
    backward goes on (DDP's overlap); the result is the same as single-device training. A
    model made out of forward order gets its buckets in backward's order after one step.

    The pause in backward is a barrier of the 4 workers, not a sleep: when a worker goes
    past it, its host-mate has written the buckets of the layers after it, however the
    two busy cores scheduled the workers, so those buckets must start before backward ends."""
    results = run_workers(h.train_pipelined, 4, args=(out_of_order, str(tmp_path)), timeout=130)
    reference = h.paused_mlp_single_device_weights(out_of_order)
    for result in results:
        assert result["pipelined"]
        assert result["buckets"] >= 6 and result["before_pause"] >= 4  # 64-byte buckets: about one per gradient
        # the barrier leaves the buckets of the layers after it written by the whole host
        steps = result["started"][1:] if out_of_order else result["started"]
        assert all(started >= result["before_pause"] for started in steps), result["started"]
        for got, want in zip(result["weights"], reference):
            assert (got - want).abs().max().item() <= 1e-5


@pytest.mark.timeout(150)
@pytest.mark.parametrize("worker", [h.two_heads_on_hosts, h.two_heads_on_hosts_with_late_trips],
                         ids=["trips-dropped-at-once", "trips-holding-their-slice"])
def test_many_gradients_live_in_their_homes_across_hosts_and_train_as_on_one_device(worker):
    """Equal hosts of two workers: a bucket of many gradients lives in each worker's home in the
    shared file from the second step on (autograd adds into it; the sums come back there), and
    trains as one device does, a head no worker used this step keeping no gradient (the flags
    are read from the homes). The gradient the program keeps at step 2 makes its bucket leave
    its home at step 3 (not before), the kept tensor is never written again, and the steps
    after go through fresh slots and the spare part of the file. A trip between hosts that
    holds its slice of the file past its wait (gloo's thread drops a finished work when it gets
    to it) is not a holder of the home: the bucket stays there all the same."""
    expected, expected_skipped = w.single_device_two_heads_training()
    results = run_workers(worker, 4, timeout=130)
    for result in results:
        assert result["pipelined"] and result["skipped"] == expected_skipped
        slots = [in_slots for _, in_slots in result["homes"]]
        assert slots == [False] + [True] * (len(slots) - 1)  # the first step fills the file from the gradients
        at_home = [home for home, _ in result["homes"]]
        assert at_home == [True] * 3 + [False] * (len(at_home) - 3)
        assert result["kept_unchanged"]
        for got, want in zip(result["weights"], expected):
            assert (got - want).abs().max().item() <= 1e-5
