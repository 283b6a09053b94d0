"""Compression on the hierarchical transport: the hop between hosts carries the half type (issue 45).

Several hosts of several workers each: the workers of a host sum exactly in shared memory,
and the host sums cross the network compressed (bf16 / fp16), or, with PowerSGD, its
factors are summed hierarchically. Before issue 45 any compression bypassed the
hierarchical transport: every worker's compressed bucket went over flat gloo.
"""

from __future__ import annotations

import pytest
import torch

from tests.collectives.transport import _hierarchical_compression_workers as hc
from tests.collectives.transport._hierarchical_workers import HOSTS, UNEQUAL_HOSTS
from tests.multi_worker import _workers as w
from unison._testing import run_workers


@pytest.fixture(scope="module")
def trained():
    return run_workers(hc.train_each, 4, timeout=200)


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


@pytest.mark.timeout(240)
def test_compression_keeps_the_hierarchical_transport(trained):
    for result in trained:
        t = result["transports"]
        assert t["exact"][0] == t["bf16"][0] == t["fp16"][0] == "HierarchicalTransport"
        assert t["powersgd"] == ["PowerSGDTransport", "HierarchicalTransport"]
        assert t["powersgd_ring"] == ["PowerSGDTransport", "PackedTransport"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("compression, wire", [("bf16", "torch.bfloat16"), ("fp16", "torch.float16")])
def test_half_types_halve_the_bytes_between_hosts(trained, compression, wire):
    for result in trained:
        exact, compressed = result["across"]["exact"], result["across"][compression]
        assert exact and {dtype for dtype, _ in exact} == {"torch.float32"}
        assert {dtype for dtype, _ in compressed} == {wire}  # every gradient byte between hosts
        assert 2 * sum(n for _, n in compressed) == sum(n for _, n in exact)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("compression", ["bf16", "fp16"])
def test_training_with_compression_between_hosts_is_close_and_equal_on_every_worker(trained, compression):
    reference = w.single_device_weights(2, 16)
    for result in trained:
        assert _max_diff(result["weights"]["exact"], reference) <= 1e-5
        assert 0 < _max_diff(result["weights"][compression], reference) < 1e-2
    for result in trained[1:]:
        mine, first = result["weights"][compression], trained[0]["weights"][compression]
        assert all(torch.equal(a, b) for a, b in zip(mine, first))


@pytest.mark.timeout(240)
def test_powersgd_factors_cross_hosts_once_per_host_and_train_as_over_ring(trained):
    """The same algorithm, its sums taken hierarchically: the weights equal PowerSGD over
    flat gloo within float round-off, and far fewer bytes cross hosts than exact training's."""
    for result in trained:
        across = result["across"]
        assert 0 < sum(n for _, n in across["powersgd"]) < sum(n for _, n in across["exact"]) / 2
        assert _max_diff(result["weights"]["powersgd"], result["weights"]["powersgd_ring"]) <= 1e-5
        assert _max_diff(result["weights"]["powersgd"], w.single_device_weights(2, 16)) > 1e-6  # compressed
    for result in trained[1:]:
        assert all(torch.equal(a, b) for a, b in zip(result["weights"]["powersgd"], trained[0]["weights"]["powersgd"]))


@pytest.mark.timeout(150)
@pytest.mark.parametrize("hosts", [HOSTS, UNEQUAL_HOSTS], ids=["2x2-columns", "2+1-leaders"])
def test_fp16_host_sums_that_overflow_cross_again_exactly(hosts):
    world = len(hosts)
    results = run_workers(hc.overflowing_fp16_sums, world, args=(hosts,), timeout=130)
    for result in results:
        assert result["transport"] == "HierarchicalTransport"
        torch.testing.assert_close(result["sums"][0], torch.full((300,), 40000.0 * world), rtol=0, atol=0)
        torch.testing.assert_close(result["sums"][1], torch.full((300,), 0.25 * sum(range(1, world + 1))))
        dtypes = [dtype for dtype, _ in result["across"]]
        assert not dtypes or dtypes[0] == "torch.float16"  # a worker on a group between hosts: float16 first
    # then float32 again, on the workers whose slice (columns) or host sum (leaders) overflowed
    assert "torch.float32" in {dtype for result in results for dtype, _ in result["across"]}
