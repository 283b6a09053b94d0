"""The shared-memory all-reduce between workers of one host, across real processes."""

from __future__ import annotations

import pytest
import torch

from tests.collectives.transport import _shared_memory_workers as w
from tests.multi_worker._workers import check_worker_1_named, single_device_weights
from unison._testing import run_workers


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_sums_and_means_match_gloo_and_leave_no_file(world):
    for result in run_workers(w.sums_means_and_reuse, world, timeout=90):
        assert result["used_shared_memory"], result
        assert result["sums_exact"] and result["kept_results_untouched"]
        assert result["means_as_gloo"] and result["means_are_sums_over_world"]
        assert result["equal_to_gloo"] and result["shapes_kept"] and result["inputs_untouched"]
        if world == 2:
            assert result["exactly_gloo"]  # a + b, the same bits whichever transport
        assert result["segments_reused"]
        assert result["files_left"] == []  # unlinked once mapped: nothing to leak in /dev/shm
        assert result["ring_transport"] is None  # implementation=RING never uses shared memory


@pytest.mark.timeout(90)
def test_mismatched_layouts_raise_on_every_worker_then_the_next_call_works():
    results = run_workers(w.mismatch_then_recover, 2, timeout=60)
    for outcomes, recovered, _ in results:
        for name, message in outcomes.items():
            assert "different shapes or dtypes" in message, (name, message)
        assert recovered
    assert results[0][2] == results[1][2]  # the same file cache on both workers


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how, reason, level", [("different hosts", "cannot map", "INFO"),
                                                ("no space", "could not create", "WARNING")])
def test_workers_that_cannot_share_memory_fall_back_together(how, reason, level, tmp_path):
    results = run_workers(w.cannot_share, 2, args=(how, str(tmp_path)), timeout=60)
    for _rank, result in enumerate(results):
        assert result["available"] is False
        assert result["correct"]
        assert result["files_left"] == []
        assert len(result["warnings"]) == 1, result["warnings"]
        assert "all-reduces go over the network collective" in result["warnings"][0]
        assert result["warnings"][0].startswith(level)  # several hosts are normal; a full /dev/shm is not
    reference = single_device_weights(1, 160)
    for result in results:  # the gradient buckets stayed on gloo, and training is still right
        assert result["shared_buckets"] and not any(result["shared_buckets"])
        assert max((got - want).abs().max().item() for got, want in zip(result["weights"], reference)) <= 1e-5
    assert reason in results[1]["warnings"][0]
    if how == "no space":
        assert "No space left on device" in results[0]["warnings"][0]


@pytest.mark.timeout(120)
def test_many_layouts_keep_a_bounded_set_of_mapped_files_and_idle_ones_go():
    from unison._collectives.transport.shared_memory import MAX_SEGMENTS

    for exact, most_segments, left in run_workers(w.many_sizes, 2, timeout=90):
        assert exact
        assert most_segments == MAX_SEGMENTS
        assert left == [(torch.float32, 5)]


@pytest.mark.timeout(120)
def test_killed_worker_is_named_during_a_shared_memory_reduce():
    timeout = 10.0
    results = run_workers(w.killed_during_shared_reduce, 2, args=(timeout,), timeout=90, allow_failures=True)
    check_worker_1_named(results, timeout, killed_at=3)


@pytest.mark.timeout(90)
def test_worker_0_killed_while_reserving_a_file_leaves_nothing_in_dev_shm(tmp_path):
    """The file is unlinked before its pages are reserved, the slow step a kill most likely hits."""
    results = run_workers(w.killed_while_reserving, 2, args=(str(tmp_path),), timeout=60, allow_failures=True)
    assert results[0].exitcode == -9
    kind, message, waited = results[1].value
    assert kind == "PeerLostError" and "worker:0" in message, message
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("bytes_per_pack", "dense_in_slots"), [(0, False), (960, True), (64, False)])
def test_dense_gradients_live_in_their_bucket_slots_and_sparse_ones_stay_sparse(bytes_per_pack, dense_in_slots):
    # From the second step, the dense gradients of a bucket of many gradients that were all
    # dense last step are aliases of its own flat slots (one copy to and from the shared
    # file); the sparse embedding's gradient stays sparse every step. One bucket for
    # everything (0): the embedding shares it, so no slots. 960-byte buckets: the 24 dense
    # gradients in one, the embedding in another. 64-byte buckets: one or two gradients
    # each, divided straight into the shared file, so no slots either.
    results = run_workers(w.gradients_in_slots, 2, args=(bytes_per_pack,), timeout=60)
    reference = w.single_device_embedding_weights()
    for result in results:
        assert all(result["shared"])
        assert [s["sparse"] for s in result["steps"]] == [True] * 5
        assert [s["dense_in_slots"] for s in result["steps"]] == [False] + [dense_in_slots] * 4
        assert result["kept_unchanged"]  # a gradient kept from step 2 is never overwritten
        for got, want in zip(result["weights"], reference):
            assert (got - want).abs().max().item() <= 1e-6
