"""HybridParameterServerStrategy with real processes: 2 MWMS workers, dynamic rows on 2 ps tasks."""

import pytest
import torch
import torch.nn.functional as F

import unison
from tests.ps import _hybrid_workers as hw
from tests.ps._cluster import ps_cluster
from unison._testing import run_workers


def _ps_addresses(cluster, count):
    return [cluster.addresses[f"ps:{i}"] for i in range(count)]


def _reference(steps, world, shared=False):
    """One device on the global batches (mean loss over all workers' samples)."""
    torch.manual_seed(0)
    model = hw.Ranker()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.2)
    for ids, features, target in hw.global_batches(steps, world, shared=shared):
        loss = F.mse_loss(model(ids, features), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


@pytest.mark.timeout(120)
def test_dense_is_bit_equal_on_every_worker_rows_match_one_device_and_survive_a_restart():
    steps = 6
    with ps_cluster(0, 2) as cluster:
        ps = _ps_addresses(cluster, 2)
        results = run_workers(hw.train, 2, args=(ps, cluster.key_hex, steps), timeout=90)
        (dense0, state0, stats0), (dense1, state1, _) = results
        for step in range(steps):  # all-reduced: identical bits on both workers after every step
            assert all(torch.equal(a, b) for a, b in zip(dense0[step], dense1[step])), step
        reference = _reference(steps, 2).state_dict()
        # disjoint rows per worker: the pushes equal the one-device update on the global batch
        assert torch.equal(state0["rows.ids"], reference["rows.ids"])
        for key in ("rows.rows", "rows.state.sum", "dense.weight", "head.weight", "head.bias"):
            torch.testing.assert_close(state0[key], reference[key], rtol=1e-5, atol=1e-6, msg=key)
        assert torch.equal(state0["rows.rows"], state1["rows.rows"])  # both read the same ps tasks
        assert sum(s["rows"] for s in stats0) == state0["rows.ids"].numel() and all(s["rows"] for s in stats0)

        # the job ends and starts again: the ps tasks kept the rows, the new workers find them
        again = run_workers(hw.rejoin, 2, args=(ps, cluster.key_hex), timeout=60)
        for ids, rows in again:
            assert torch.equal(ids, state0["rows.ids"]) and torch.equal(rows, state0["rows.rows"])


def assert_rows_of_one_device(state, steps, world, shared):
    reference = _reference(steps, world, shared).state_dict()
    assert torch.equal(state["rows.ids"], reference["rows.ids"])
    for key in ("rows.rows", "rows.state.sum", "dense.weight", "head.weight", "head.bias"):
        torch.testing.assert_close(state[key], reference[key], rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.timeout(120)
def test_rows_both_workers_push_in_a_step_take_one_step_with_the_global_batchs_gradient():
    # each ps task sums the workers' pushes of a step and applies them once, and each pull waits for
    # the step before: Adagrad's state and the rows are one device's (two steps of the halves differ)
    steps = 6
    with ps_cluster(0, 2) as cluster:
        (_, state, _), _ = run_workers(hw.train, 2, args=(_ps_addresses(cluster, 2), cluster.key_hex, steps, True),
                                       timeout=90)
    assert_rows_of_one_device(state, steps, 2, shared=True)


@pytest.mark.timeout(120)
def test_a_pull_waiting_for_a_push_that_never_comes_names_the_step_within_the_timeout():
    with ps_cluster(0, 2) as cluster:
        message, skipped = run_workers(hw.skip_a_push, 2, args=(_ps_addresses(cluster, 2), cluster.key_hex),
                                       timeout=90)
    assert skipped == "skipped", skipped  # worker 1 stayed, its connections open
    # the ps task's wait, 0.8 of the strategy's 2.5 s timeout, ended it: not the client giving up on the ps task
    assert "waited 2 s for global step 2" in message and "1 worker(s) pushed step 2" in message, message


@pytest.mark.timeout(120)
def test_a_lost_ps_task_is_named_on_every_worker_within_the_timeout():
    with ps_cluster(0, 2) as cluster:
        ps = _ps_addresses(cluster, 2)
        messages = run_workers(hw.lose_a_ps, 2, args=(ps, cluster.key_hex, cluster.procs["ps:1"].pid), timeout=90)
    assert all("ps:1" in m for m in messages), messages


def test_it_needs_ps_tasks_and_a_training_task():
    spec = unison.ClusterSpec({"worker": ["127.0.0.1:1", "127.0.0.1:2"]})
    with pytest.raises(ValueError, match="--ps M"):
        unison.HybridParameterServerStrategy(unison.SimpleClusterResolver(spec, task_type="worker", task_id=0))
    spec = unison.ClusterSpec({"worker": ["127.0.0.1:1"], "ps": ["127.0.0.1:3"]})
    with pytest.raises(ValueError, match="unison.Server"):
        unison.HybridParameterServerStrategy(unison.SimpleClusterResolver(spec, task_type="ps", task_id=0))


@pytest.mark.timeout(120)
def test_a_fixed_table_selected_by_size_trains_on_the_ps_from_the_chiefs_values():
    steps = 4
    torch.manual_seed(10)
    reference = hw._fixed_model(10)
    opt = torch.optim.Adagrad(reference.parameters(), lr=0.2)
    for ids, target in hw.fixed_batches(steps, 2):
        loss = F.mse_loss(reference["head"](reference["table"](ids)).squeeze(1), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with ps_cluster(0, 2) as cluster:
        results = run_workers(hw.train_fixed, 2, args=(_ps_addresses(cluster, 2), cluster.key_hex, steps), timeout=90)
    for moved, state in results:
        assert moved == ["table"]
        assert torch.equal(state["table.ids"], torch.arange(64))  # every row of the table, and no other
        torch.testing.assert_close(state["table.rows"], reference["table"].weight.detach(), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(state["head.weight"], reference["head"].weight.detach(), rtol=1e-4, atol=1e-5)
