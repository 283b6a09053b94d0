"""MultiWorkerMirroredStrategy across real processes (gloo on 127.0.0.1)."""

from __future__ import annotations

import pytest
import torch

import unison
from tests.multi_worker import _workers as w
from unison._collectives.transport import shm_signals
from unison._testing import run_workers


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("local_devices", "extra_layers", "set_to_none", "width", "implementation"),
                         [(1, 0, True, 16, "AUTO"), (1, 0, True, 16, "RING"), (2, 0, True, 16, "AUTO"),
                          (1, 8, True, 16, "RING"), (1, 0, False, 16, "RING"), (1, 8, False, 16, "RING"),
                          (1, 8, False, 16, "AUTO"), (1, 1, True, 160, "AUTO")])
def test_two_workers_match_single_device(local_devices, extra_layers, set_to_none, width, implementation):
    # 4 gradients: each divided straight into its bucket slot; 20: one foreach copy, then one
    # division. set_to_none=False keeps gradients as bucket views, reduced in place. AUTO:
    # the buckets live in shared memory (the workers share this host); RING: gloo. Width
    # 160 with 4 KB buckets: several shared buckets.
    shared_buckets = implementation == "AUTO"
    bucket_bytes = 4 << 10 if width == 160 else 0
    results = run_workers(w.train_mlp, 2, args=(local_devices, extra_layers, set_to_none, width, bucket_bytes,
                                                 implementation), timeout=90)
    reference = w.single_device_weights(extra_layers, width)
    for rank, result in enumerate(results):
        assert result["replicas"] == 2 * local_devices
        assert result["chief"] is (rank == 0)
        assert result["replicas_equal"]
        if local_devices == 1:
            assert len(result["buckets"]) >= (2 if width == 160 else 1)
            assert result["buckets"] == [shared_buckets] * len(result["buckets"])  # all in shared memory, or none
        for got, want in zip(result["weights"], reference):
            assert (got - want).abs().max().item() <= 1e-5
    assert results[0]["loss"] == pytest.approx(results[1]["loss"])


@pytest.mark.timeout(90)
def test_seed_example_reduce_and_update_across_processes():
    assert run_workers(w.seed_example, 2, timeout=60) == [2.0, 2.0]


@pytest.mark.timeout(90)
def test_variables_start_from_the_chiefs_values():
    (params0, v0), (params1, v1) = run_workers(w.chief_values_win, 2, timeout=60)
    for a, b in zip(params0, params1):
        assert torch.equal(a, b)
    assert torch.equal(v0, torch.full((2,), 5.0)) and torch.equal(v1, v0)


@pytest.mark.timeout(90)
def test_mismatched_shapes_raise_on_every_worker():
    for kind, message in run_workers(w.mismatched_all_reduce, 2, timeout=60):
        assert kind == "CollectiveMismatchError"
        assert "different shapes or dtypes" in message
        assert "(3,)" in message or "(4,)" in message


@pytest.mark.timeout(120)
@pytest.mark.parametrize("implementation", ["AUTO", "RING"])  # shared-memory buckets, gloo buckets
def test_killed_worker_is_named_by_the_survivor_within_the_timeout(implementation):
    timeout = 10.0
    results = run_workers(w.killed_mid_training, 2, args=(timeout, implementation), timeout=90, allow_failures=True)
    shared, signals = w.check_worker_1_named(results, timeout, killed_at=5)
    assert shared == (implementation == "AUTO")
    if signals:  # waiting on shared counters: the death is seen through /proc, long before the timeout
        assert results[0].value[2] < timeout / 2, results[0].value
    assert signals == (implementation == "AUTO" and shm_signals.supported())


@pytest.mark.timeout(90)
@pytest.mark.parametrize("implementation", ["AUTO", "RING"])  # AUTO: the buckets live in shared memory
def test_no_sync_accumulation_and_unused_parameters(implementation):
    results = run_workers(w.grad_accumulation_and_unused, 2, args=(implementation,), timeout=60)
    (weights0, unused0, shared0), (weights1, unused1, shared1) = results
    assert shared0 == shared1 == (implementation == "AUTO")
    model = w.make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = w.global_batches(steps=1, batch=64)[0]
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    for got0, got1, want in zip(weights0, weights1, model.parameters()):
        assert torch.allclose(got0, want.detach(), atol=1e-6) and torch.equal(got0, got1)
    assert unused0 is unused1 is True  # no gradient on either worker: none after the reduction


@pytest.mark.timeout(90)
def test_sparse_gradients_travel_by_all_gather():
    weights = run_workers(w.sparse_embedding, 2, timeout=60)
    torch.manual_seed(0)
    reference = torch.nn.Embedding(10, 3).weight.detach().clone()
    reference[[1, 2, 3, 4]] -= 0.5  # each row gets gradient 1 on one worker: mean over 2 workers
    for got in weights:
        assert torch.allclose(got, reference)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("implementation", ["AUTO", "RING"], ids=["shared_memory", "gloo"])
def test_a_sparse_gradient_only_one_worker_computed_reaches_both(implementation):
    """Worker 1 computes no gradient for the sparse embedding this step, worker 0 a sparse one:
    both join one sparse all-reduce (worker 0's flag says so), and both step with the mean."""
    results = run_workers(w.sparse_embedding_on_one_worker, 2, args=(implementation,), timeout=60)
    torch.manual_seed(0)
    emb, head = torch.nn.Embedding(10, 3), torch.nn.Linear(3, 1)
    ids = torch.tensor([[1, 2], [3, 4]])
    loss = (head(emb(ids[0])).sum() + head(emb.weight[ids[1]].detach()).sum()) / 2  # the mean of both workers'
    loss.backward()
    with torch.no_grad():
        for p in (*emb.parameters(), *head.parameters()):
            p -= p.grad
    for got_emb, got_weight, got_bias, sparse in results:
        assert sparse is True  # worker 1 too gets the (sparse) sum, not a dense zero gradient
        assert torch.allclose(got_emb, emb.weight, atol=1e-6)
        assert torch.allclose(got_weight, head.weight, atol=1e-6) and torch.allclose(got_bias, head.bias, atol=1e-6)
    assert torch.equal(results[0][0], results[1][0])


@pytest.mark.timeout(90)
def test_a_sparse_gradient_one_worker_skips_with_two_local_devices_is_refused_with_the_way_out():
    for message in run_workers(w.sparse_embedding_on_one_worker_of_two_devices, 2, timeout=60):
        assert message is not None and "sparse gradient" in message and "one device per worker" in message


@pytest.mark.timeout(90)
def test_a_frozen_sparse_embedding_woken_where_one_worker_uses_it():
    results = run_workers(w.frozen_sparse_embedding_unfrozen, 2, timeout=60)
    torch.manual_seed(0)
    emb, head = torch.nn.Embedding(10, 3), torch.nn.Linear(3, 1)
    ids = torch.tensor([[1, 2], [3, 4]])
    for emb_used_by in ((), (0,)):  # step 1: frozen; step 2: trainable, used by worker 0 only
        emb.zero_grad(), head.zero_grad()
        loss = sum(head(emb(ids[r]) if r in emb_used_by else emb.weight[ids[r]].detach()).sum() for r in (0, 1)) / 2
        loss.backward()
        with torch.no_grad():
            for p in (*emb.parameters(), *head.parameters()):
                if p.grad is not None:
                    p -= p.grad
    for got_emb, got_head in results:
        assert torch.allclose(got_emb, emb.weight, atol=1e-6) and torch.allclose(got_head, head.weight, atol=1e-6)


@pytest.mark.timeout(90)
def test_a_sparse_sum_joined_without_a_tensor():
    expected = torch.zeros(4, 3)
    expected[0] = 1.0  # worker 0's one row; worker 1 joins with none
    for dense, sparse_dim, nothing, mismatch, no_like in run_workers(w.sparse_sums, 2, timeout=60):
        assert torch.equal(dense, expected) and sparse_dim == 1
        assert nothing is None
        assert mismatch is not None and "[1, 2] sparse dimensions" in mismatch
        assert "needs `like`" in no_like


@pytest.mark.timeout(90)
def test_gather_and_all_gather_span_every_worker():
    expected_rows = torch.cat([torch.full((r + 1, 2), float(r)) for r in range(4)])
    for gathered, all_gathered, summed in run_workers(w.gathers, 2, timeout=60):
        assert torch.equal(gathered, expected_rows)  # replicas 0..3 of both workers, in order
        assert all_gathered == [[0.0, 1.0, 2.0, 3.0]] * 2
        assert torch.equal(summed, expected_rows.sum(dim=0))


@pytest.mark.timeout(90)
def test_gradients_are_reduced_when_backward_returns():
    model = w.make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    want_norms = []
    for x, y in w.global_batches(steps=5):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        want_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)))
        opt.step()
    for weights, norms in run_workers(w.clipped_training, 2, timeout=60):
        assert norms == pytest.approx(want_norms, rel=1e-5)
        for got, want in zip(weights, model.parameters()):
            assert (got - want.detach()).abs().max().item() <= 1e-6


@pytest.mark.timeout(90)
def test_buffers_start_from_the_chiefs_values():
    for noise, chiefs in run_workers(w.buffers_from_chief, 2, timeout=60):
        assert torch.equal(noise, chiefs)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("implementation", ["AUTO", "RING"])
def test_packed_batch_reduce_sums_and_averages_exactly(implementation):
    results = run_workers(w.packed_batch_reduce, 2, args=(implementation,), timeout=60)
    for sum_error, mean_error, shapes_kept, inputs_untouched, used_shared_memory in results:
        assert sum_error <= 1e-6 and mean_error <= 1e-6
        assert shapes_kept and inputs_untouched
        assert used_shared_memory == (implementation == "AUTO")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("implementation", ["AUTO", "RING"])
def test_different_reduce_ops_raise_on_every_worker(implementation):
    """Issue 17 item 3: "sum" on one worker and "mean" on the other gave [3.0, 1.5]."""
    results = run_workers(w.mismatched_reduce_ops, 2, args=(implementation,), timeout=60)
    for kind, message in results:
        assert kind == "CollectiveMismatchError", (kind, message)
        assert "different reduce ops" in message


@pytest.mark.timeout(90)
@pytest.mark.parametrize("implementation", ["AUTO", "RING"])
def test_a_skipped_call_is_named_as_differing_call_sequences(implementation):
    """Issue 17 item 3: a worker that skipped a reduce paired its next call with the peer's skipped one (11.0)."""
    results = run_workers(w.skipped_reduce, 2, args=(implementation,), timeout=60)
    for kind, message in results:
        assert kind == "CollectiveMismatchError", (kind, message)
        assert "call sequences differ" in message and "worker:0" in message and "worker:1" in message


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("which", "named"), [("skipped", "call sequences differ"), ("ops", "different reduce ops"),
                                              ("gather", "call sequences differ")])
def test_a_mismatch_is_caught_where_the_signatures_meet_in_shared_memory(which, named):
    """On one host, once the first reduce made the shared counters, the per-call check compares there (no gloo
    all-gather a call); a worker whose call differs still makes every worker raise, naming the difference."""
    for first, shared, kind, message in run_workers(w.mismatch_after_shared_counters, 2, args=(which,), timeout=60):
        assert first == 3.0 and shared  # the matching reduce summed, through the shared counters' path
        assert kind == "CollectiveMismatchError" and named in message, (kind, message)


@pytest.mark.timeout(90)
def test_buckets_follow_backwards_gradient_order_after_the_first_step():
    """As DDP's bucket rebuild: a model made out of forward order (make_mlp makes its hidden
    layers first) starts with buckets in reverse registration order; after the first step
    they follow the order backward produced the gradients in, and training is unchanged."""
    results = run_workers(w.bucket_order_over_gloo, 2, timeout=80)
    reference = w.single_device_weights(2, 16)
    for result in results:
        flat_before = [name for bucket in result["before"] for name in bucket]
        flat_after = [name for bucket in result["after"] for name in bucket]
        assert flat_before != result["gradient_order"]  # the model's registration order is not backward's
        assert flat_after == result["gradient_order"]
        for got, want in zip(result["weights"], reference):
            assert (got - want).abs().max().item() <= 1e-5


def _assert_weights_close(weights: list, expected: list) -> None:
    """A worker's weights equal single-device training's (round-off of the mean over workers)."""
    assert len(weights) == len(expected)
    for got, want in zip(weights, expected):
        assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("implementation, asymmetric", [("AUTO", False), ("RING", True)])
def test_a_dropped_model_leaves_the_buckets_on_every_worker(implementation, asymmetric):
    # A model built in scope and dropped was kept alive by the buckets and all-reduced (as
    # zeros) in every later backward. It leaves at the next scope that makes variables, on
    # every worker, even where the program still holds it (asymmetric: worker 1).
    results = run_workers(w.dropped_model_leaves_the_buckets, 2, args=(implementation, asymmetric), timeout=60)
    expected = w.single_device_weights()
    for released, untouched, weights, in_buckets in results:
        assert released and untouched
        assert in_buckets == 4  # the new MLP's two layers, not the dropped model's ten parameters
        _assert_weights_close(weights, expected)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("implementation", ["AUTO", "RING"])
def test_a_frozen_layer_gets_no_gradient_and_stays_put(implementation):
    # Every bucketed parameter used to be handed the workers' mean, zeros for a layer frozen
    # with requires_grad_(False): AdamW's weight decay then moved the frozen layer.
    expected, expected_none = w.single_device_frozen_layer_training()
    assert expected_none
    for weights, grad_is_none in run_workers(w.frozen_layer_training, 2, args=(implementation,), timeout=60):
        assert grad_is_none
        _assert_weights_close(weights, expected)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("implementation", ["AUTO", "RING"])
def test_a_head_no_worker_used_keeps_no_gradient(implementation):
    # A parameter no worker computed a gradient for got the workers' mean of zeros, where
    # one device leaves None and the optimizer skips it (DDP's find_unused_parameters the same).
    expected, expected_skipped = w.single_device_two_heads_training()
    assert expected_skipped[:5] == [[]] * 5 and expected_skipped[5:7] == [[0], [1]]
    for weights, skipped in run_workers(w.two_heads_training, 2, args=(implementation,), timeout=60):
        assert skipped == expected_skipped
        _assert_weights_close(weights, expected)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("local_devices", [1, 2])
def test_grad_scaler_trains_as_on_one_device(local_devices):
    # With two local replicas the replica threads shared the scaler's per-optimizer state
    # and failed the step; an overflow on worker 1 must skip the step on both workers.
    expected, expected_scales = w.single_device_grad_scaler_training()
    assert expected_scales[7] == expected_scales[6] / 2
    for weights, scales in run_workers(w.grad_scaler_training, 2, args=(local_devices,), timeout=60):
        assert scales == expected_scales
        _assert_weights_close(weights, expected)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("local_devices, dry_run_in_scope", [(1, True), (2, False)])
def test_a_lazy_model_starts_from_the_chiefs_weights_and_trains_as_on_one_device(local_devices, dry_run_in_scope):
    # Uninitialised parameters reached the variable policy, which failed on them.
    expected = w.single_device_lazy_model_training()
    for weights in run_workers(w.lazy_model_training, 2, args=(local_devices, dry_run_in_scope), timeout=60):
        _assert_weights_close(weights, expected)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("local_devices, in_step", [(1, True), (1, False), (2, True)])
def test_a_parameter_made_frozen_and_unfrozen_later_trains_as_on_one_device(local_devices, in_step):
    # A parameter created with requires_grad=False was never registered for reduction:
    # once unfrozen, each worker stepped it with its own gradient and the workers drifted apart.
    expected = w.single_device_unfreezing_training()
    assert not torch.equal(expected[-1], torch.full((4,), 0.5))  # the scale trained after step 3
    for weights in run_workers(w.unfreezing_training, 2, args=(local_devices, in_step), timeout=60):
        _assert_weights_close(weights, expected)


@pytest.mark.timeout(90)
def test_a_parameter_unfrozen_on_one_worker_only_fails_every_worker_with_the_likely_cause():
    # Every heartbeat is alive: the error used to say only "a peer crashed, was killed or did not answer".
    for message in run_workers(w.unfreezing_on_one_worker_only, 2, timeout=60):
        assert "every heartbeat is alive" in message and "unfroze a parameter the others did not" in message


def _used_on_one_worker_with_grads(rank: int, world: int):
    """Two local replicas per worker; layer ``b`` is used only on worker 0, layer ``c`` nowhere.
    Returns the weights, each step's reduced gradients of ``a`` and ``b`` as every local
    replica has them after backward, whether ``c`` kept no gradient, and whether it stayed
    (AdamW's decay would move it otherwise)."""
    strategy = w.strategy_for(rank, world, devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        torch.manual_seed(0)
        a, b, c = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        opt = torch.optim.AdamW([*a.parameters(), *b.parameters(), *c.parameters()], lr=0.1, weight_decay=0.5)
    c_before = c.weight.detach().clone()
    grads: list[dict] = []  # per step: each local replica's gradients, by replica id

    def step(x):
        opt.zero_grad()
        out = a(x)
        if rank == 0:
            out = b(out)
        out.pow(2).sum().backward()
        replica = unison.get_replica_context().replica_id_in_sync_group
        grads[-1][replica] = [p.grad.detach().clone() for p in [*a.parameters(), *b.parameters()]]
        opt.step()
        return c.weight.grad is None

    none = []
    for _ in range(3):
        grads.append({})
        none.append(strategy.run(step, args=(torch.full((4, 4), 0.5),)))
    return ([p.detach().clone() for p in [*a.parameters(), *b.parameters()]],
            [list(replicas.values()) for replicas in grads],
            all(v for n in none for v in strategy.experimental_local_results(n)),
            torch.equal(c.weight.detach(), c_before))


def _plain_used_on_one_worker() -> tuple[list, list]:
    """The oracle in plain PyTorch: the mean over the 4 replicas (2 per worker) of their
    gradients, where worker 1's replicas have a zero gradient for ``b``, so ``b`` gets half
    of worker 0's; AdamW then steps ``a`` and ``b`` (``c`` has no gradient). The weights
    after 3 steps and each step's gradients."""
    torch.manual_seed(0)
    a, b, c = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW([*a.parameters(), *b.parameters(), *c.parameters()], lr=0.1, weight_decay=0.5)
    x = torch.full((4, 4), 0.5)
    grads = []
    for _ in range(3):
        opt.zero_grad()
        hidden = a(x)
        worker0, worker1 = b(hidden).pow(2).sum(), hidden.pow(2).sum()
        ((2 * worker0 + 2 * worker1) / 4).backward()
        grads.append([p.grad.clone() for p in [*a.parameters(), *b.parameters()]])
        opt.step()
    assert c.weight.grad is None
    return [p.detach().clone() for p in [*a.parameters(), *b.parameters()]], grads


@pytest.mark.timeout(90)
def test_several_local_replicas_reduce_a_layer_only_one_worker_used():
    # Each worker reduced only the variables its replicas had gradients for: the workers'
    # lists differed and the reduction failed with a CollectiveMismatchError.
    results = run_workers(_used_on_one_worker_with_grads, 2, timeout=60)
    expected_weights, expected_grads = _plain_used_on_one_worker()
    for weights, grads, c_none, c_kept in results:
        assert c_none and c_kept  # used nowhere: no gradient, not moved
        # b's gradient is the mean over all 4 replicas, worker 1's zeros included (half of
        # worker 0's): AdamW's update hardly shows a factor of 2, so the gradients are checked
        for step, want in enumerate(expected_grads):
            assert len(grads[step]) == 2
            for replica in grads[step]:
                for got, expected in zip(replica, want):
                    torch.testing.assert_close(got, expected)
        _assert_weights_close(weights, expected_weights)
    for got0, got1 in zip(results[0][0], results[1][0]):
        assert torch.equal(got0, got1)  # b's gradient from worker 0 reached worker 1 too
