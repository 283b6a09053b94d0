"""Gradient compression (CommunicationOptions(compression=...)): bf16 and fp16 on the wire, fp16 overflow made exact."""

from __future__ import annotations

import pytest
import torch

import unison
from tests.collectives.transport import _compression_workers as c
from unison._testing import run_workers


@pytest.mark.parametrize("value, member", [("bf16", unison.Compression.BF16), ("FP16", unison.Compression.FP16),
                                           (None, unison.Compression.NONE), (unison.Compression.BF16,
                                                                             unison.Compression.BF16)])
def test_compression_accepts_names_members_and_none(value, member):
    assert unison.CommunicationOptions(compression=value).compression is member


def test_an_unknown_compression_names_the_field_and_the_choices():
    with pytest.raises(ValueError, match=r"CommunicationOptions.compression 'int8' .* NONE, BF16, FP16"):
        unison.CommunicationOptions(compression="int8")


def test_merged_options_keep_the_compression():
    merged = unison.CommunicationOptions(timeout_seconds=5).merge(unison.CommunicationOptions(compression="fp16"))
    assert merged.compression is unison.Compression.FP16 and merged.timeout_seconds == 5


@pytest.mark.timeout(90)
@pytest.mark.parametrize("compression, tolerance", [("bf16", 1e-2), ("fp16", 1e-3)])
def test_batch_reduces_are_close_to_exact_and_integers_exact(compression, tolerance):
    results = run_workers(c.batch_reduces, 2, args=(compression, 1.0), timeout=60)
    for result in results:
        assert result["transport"] == "CompressedTransport"
        for i, got in enumerate(result["means"]):
            want = (results[0]["inputs"][i] + results[1]["inputs"][i]) / 2
            if i == 2:
                assert torch.equal(got, want)  # integers never travel compressed
            else:
                assert got.dtype == want.dtype
                torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
                assert not torch.equal(got, want)  # it did travel compressed: the rounding shows
    assert all(torch.equal(a, b) for a, b in zip(results[0]["means"], results[1]["means"]))


@pytest.mark.timeout(90)
def test_fp16_sums_that_overflow_are_done_again_exactly():
    results = run_workers(c.batch_reduces, 2, args=("fp16", 1e5), timeout=60)  # sums of ~2e5 > 65504
    for result in results:
        for i in (0, 1):
            want = (results[0]["inputs"][i] + results[1]["inputs"][i]) / 2
            assert torch.equal(result["means"][i], want)


@pytest.fixture(scope="module")
def exact_weights():
    """The uncompressed training's weights (worker 0), once for the module."""
    return run_workers(c.train, 2, args=("none",), timeout=100)[0]["weights"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("compression", ["bf16", "fp16"])
def test_training_with_compression_stays_close_and_equal_on_every_worker(compression, exact_weights):
    results = run_workers(c.train, 2, args=(compression,), timeout=100)
    exact = exact_weights
    for result in results:
        assert result["compressed_buckets"] >= 1 and result["shared_buckets"] == 0
        difference = max((g - e).abs().max().item() for g, e in zip(result["weights"], exact))
        assert 0 < difference < 1e-2
    assert all(torch.equal(a, b) for a, b in zip(results[0]["weights"], results[1]["weights"]))


def _plain_sgd(scale: float) -> list[torch.Tensor]:
    """``c.train`` in plain PyTorch: the same MLP and SGD on one device, on the global batch."""
    model = c.make_mlp(2, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1 / scale)
    for x, y in c.global_batches():
        opt.zero_grad()
        (torch.nn.functional.cross_entropy(model(x), y) * scale).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.timeout(120)
def test_fp16_gradient_buckets_that_overflow_train_exactly():
    """A loss scaled by 1e8 (lr divided back) overflows float16 sums at every step: the
    buckets go again in float32, so training equals the uncompressed run, and plain SGD
    on one device within float32 round-off (1e-6; the float16 sums of an unscaled loss end
    up to 1e-5 away)."""
    compressed = run_workers(c.train, 2, args=("fp16", 1e8), timeout=100)
    exact = run_workers(c.train, 2, args=("none", 1e8), timeout=100)
    initial = [p.detach() for p in c.make_mlp(2, 16).parameters()]
    plain = _plain_sgd(1e8)
    for result in compressed:
        for a, b, start, want in zip(result["weights"], exact[0]["weights"], initial, plain):
            assert torch.equal(a, b)
            assert (a - start).abs().max() > 1e-3  # it trained
            torch.testing.assert_close(a, want, rtol=0, atol=1e-6)


def test_the_overflow_check_sees_inf_and_nan_and_passes_empty_tensors():
    from unison._collectives.transport.compression import Compressor

    fp16, bf16 = Compressor(unison.Compression.FP16), Compressor(unison.Compression.BF16)
    assert fp16.overflowed(torch.tensor([1.0, float("inf")], dtype=torch.float16))
    assert fp16.overflowed(torch.tensor([float("nan"), 2.0], dtype=torch.float16))
    assert not fp16.overflowed(torch.tensor([65504.0, -65504.0], dtype=torch.float16))
    assert not fp16.overflowed(torch.empty(0, dtype=torch.float16))
    assert not bf16.overflowed(torch.tensor([float("inf")], dtype=torch.bfloat16))  # bfloat16 has float32's range
    assert fp16.compresses(torch.zeros(2)) and not fp16.compresses(torch.zeros(2, dtype=torch.float16))
    assert not fp16.compresses(torch.zeros(2, dtype=torch.int64))


@pytest.mark.timeout(120)
def test_powersgd_training_keeps_workers_equal_and_close_to_exact(exact_weights):
    results = run_workers(c.train, 2, args=(unison.PowerSGD(rank=2, start_iter=3),), timeout=100)
    exact = exact_weights
    assert all(torch.equal(a, b) for a, b in zip(results[0]["weights"], results[1]["weights"]))
    difference = max((g - e).abs().max().item() for g, e in zip(results[0]["weights"], exact))
    assert 0 < difference < 0.1


@pytest.mark.timeout(120)
def test_powersgd_skips_only_the_step_that_overflowed():
    # Error feedback kept the overflowed step's inf: every later step overflowed too and
    # the GradScaler skipped all of them (its scale fell to 0.0156 in 14 steps). The
    # skipped step must leave PowerSGD's state as if its batch never came.
    overflowed = run_workers(c.powersgd_with_grad_scaler, 2, args=(6,), timeout=100)
    assert [r["skipped"] for r in overflowed] == [[6], [6]]
    without = run_workers(c.powersgd_with_grad_scaler, 2, args=(None, 6), timeout=100)
    assert without[0]["skipped"] == []
    for a, b, c_ in zip(overflowed[0]["weights"], overflowed[1]["weights"], without[0]["weights"]):
        assert torch.equal(a, b)
        assert torch.allclose(a, c_, rtol=0, atol=1e-6), (a - c_).abs().max()
