"""Tests for unison._collectives.transport.in_process and unison._collectives.compat.placement."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from unison._collectives.compat.placement import LeastLoadedDeviceSetter
from unison._collectives.compat.tensorpack import (
    OverrideCachingDevice,
    aggregate_grads_colocate,
    allreduce_grads_naive,
    merge_grad_list,
    split_grad_list,
)
from unison._collectives.transport.in_process import aggregate_grads, allreduce_grads, allreduce_grads_hierarchical

FAST = settings(max_examples=40)
CPUS = [f"cpu:{i}" for i in range(8)]

shapes = st.lists(st.lists(st.integers(0, 4), max_size=3).map(tuple), min_size=0, max_size=5)


def _grid(num_devices: int, shape_list, seed: int, dtype=torch.float64) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in shape_list]
        for _ in range(num_devices)
    ]


def _oracle(all_grads, n: int, average: bool) -> torch.Tensor:
    total = sum(grads[n] for grads in all_grads)
    return total / len(all_grads) if average else total


def _snapshot(all_grads):
    return [[g.clone() for g in grads] for grads in all_grads]


def _assert_unchanged(all_grads, snapshot):
    for grads, saved in zip(all_grads, snapshot):
        for g, s in zip(grads, saved):
            assert torch.equal(g, s), "inputs must not be modified"


# --- split / merge ------------------------------------------------------------------


def test_split_and_merge_grad_list_are_inverse():
    grad_list = [[(torch.ones(1) * k, f"v{n}") for n in range(3)] for k in range(2)]
    all_grads, all_vars = split_grad_list(grad_list)
    assert all_vars == [["v0", "v1", "v2"]] * 2
    assert [[float(g) for g in gs] for gs in all_grads] == [[0.0] * 3, [1.0] * 3]
    assert merge_grad_list(all_grads, all_vars) == [list(t) for t in grad_list]


def test_split_and_merge_errors():
    with pytest.raises(ValueError, match="grad_list"):
        split_grad_list([])
    with pytest.raises(TypeError, match=r"grad_list\[0\]\[1\].*pair"):
        split_grad_list([[(torch.zeros(1), "v"), torch.zeros(1)]])
    with pytest.raises(ValueError, match=r"all_vars. has \[2, 1\]"):
        merge_grad_list([[1, 2], [3, 4]], [["a", "b"], ["c"]])


# --- allreduce_grads ------------------------------------------------------------------


@FAST
@given(st.integers(1, 4), shapes, st.booleans(), st.sampled_from(["nccl", "collective"]), st.integers(0, 2**16))
def test_allreduce_grads_equals_sum_oracle(num_devices, shape_list, average, mode, seed):
    all_grads = _grid(num_devices, shape_list, seed)
    saved = _snapshot(all_grads)
    out = allreduce_grads(all_grads, average=average, mode=mode)
    _assert_unchanged(all_grads, saved)
    assert len(out) == num_devices and all(len(o) == len(shape_list) for o in out)
    for n in range(len(shape_list)):
        expected = _oracle(all_grads, n, average)
        for k in range(num_devices):
            assert out[k][n].shape == expected.shape and out[k][n].dtype == expected.dtype
            torch.testing.assert_close(out[k][n], expected, rtol=0, atol=0)


def test_allreduce_grads_outputs_are_independent_per_device():
    all_grads = _grid(3, [(4,), (2, 2)], seed=0)
    out = allreduce_grads(all_grads, average=False, mode="nccl")
    out[1][0].zero_()
    assert torch.equal(out[0][0], _oracle(all_grads, 0, False))
    assert torch.equal(out[2][0], _oracle(all_grads, 0, False))
    assert len({o[0].data_ptr() for o in out}) == 3


def test_allreduce_grads_single_device_passes_through():
    grads = [torch.ones(2), torch.zeros(3)]
    out = allreduce_grads([grads], average=True)
    assert out[0][0] is grads[0] and out[0][1] is grads[1]


def test_allreduce_grads_integer_sum_and_mean_error():
    all_grads = [[torch.tensor([1, 2])], [torch.tensor([3, 4])]]
    assert torch.equal(allreduce_grads(all_grads, average=False)[1][0], torch.tensor([4, 6]))
    with pytest.raises(TypeError, match="average=True needs floating-point.*torch.int64"):
        allreduce_grads(all_grads, average=True)


@pytest.mark.parametrize(
    ("all_grads", "kwargs", "error", "match"),
    [
        ([[torch.zeros(1)]] * 2, {"mode": "ring"}, ValueError, r"mode 'ring' is not an all-reduce mode"),
        ([], {}, ValueError, r"`all_grads` is empty"),
        ([[torch.zeros(1)], []], {}, ValueError, r"lengths \[1, 0\]"),
        ([[torch.zeros(2)], [torch.zeros(3)]], {}, ValueError, r"all_grads\[1\]\[0\].*\(3,\).*\(2,\)"),
        ([[torch.zeros(2)], [torch.zeros(2, dtype=torch.float64)]], {}, ValueError, r"all_grads\[1\]\[0\].*float64"),
        ([[torch.zeros(2)], [None]], {}, TypeError, r"all_grads\[1\]\[0\].*NoneType.*filter out"),
        (torch.zeros(2, 2), {}, TypeError, r"list of K per-device lists"),
    ],
)
def test_allreduce_grads_rejects_bad_input(all_grads, kwargs, error, match):
    with pytest.raises(error, match=match):
        allreduce_grads(all_grads, average=False, **kwargs)


# --- hierarchical -------------------------------------------------------------------


@FAST
@given(shapes, st.booleans(), st.integers(0, 2**16))
def test_hierarchical_equals_sum_oracle_on_eight_logical_cpus(shape_list, average, seed):
    all_grads = _grid(8, shape_list, seed)
    saved = _snapshot(all_grads)
    out = allreduce_grads_hierarchical(all_grads, CPUS, average=average)
    _assert_unchanged(all_grads, saved)
    assert len(out) == 8
    for n in range(len(shape_list)):
        expected = _oracle(all_grads, n, average)
        for k in range(8):
            torch.testing.assert_close(out[k][n], expected)
        # Every device agrees bit for bit.
        assert all(torch.equal(out[k][n], out[0][n]) for k in range(8))


def test_hierarchical_is_exact_on_integers_and_outputs_are_independent():
    all_grads = [[torch.full((3,), k + 1, dtype=torch.int64), torch.arange(4) * k] for k in range(8)]
    out = allreduce_grads_hierarchical(all_grads, CPUS)
    for k in range(8):
        assert torch.equal(out[k][0], torch.full((3,), 36))
        assert torch.equal(out[k][1], torch.arange(4) * 28)
    assert len({out[k][n].data_ptr() for k in range(8) for n in range(2)}) == 16


def test_hierarchical_rejects_other_device_counts():
    with pytest.raises(ValueError, match="exactly 8 devices.*got 4"):
        allreduce_grads_hierarchical(_grid(4, [(2,)], 0), CPUS[:4])
    with pytest.raises(ValueError, match="has 7 device lists but `devices` names 8"):
        allreduce_grads_hierarchical(_grid(7, [(2,)], 0), CPUS)
    with pytest.raises(ValueError, match="twice"):
        allreduce_grads_hierarchical(_grid(8, [(2,)], 0), CPUS[:7] + ["cpu:0"])


# --- aggregate_grads / allreduce_grads_naive ------------------------------------------


def _pairs(all_grads):
    variables = [torch.nn.Parameter(torch.zeros(g.shape, dtype=g.dtype)) for g in all_grads[0]]
    return [list(zip(grads, variables)) for grads in all_grads], variables


PLACES = st.sampled_from(["colocate", "devices", "default"])


@FAST
@given(st.integers(2, 4), shapes, st.booleans(), PLACES, st.integers(0, 99))
def test_aggregate_grads_equals_sum_oracle(num_devices, shape_list, average, where, seed):
    all_grads = _grid(num_devices, shape_list, seed)
    pairs, variables = _pairs(all_grads)
    if where == "colocate":
        out = aggregate_grads_colocate(pairs, average=average)
    elif where == "devices":
        out = aggregate_grads(pairs, devices=["cpu:0", "cpu:1"], average=average)
    else:
        out = aggregate_grads(pairs, average=average)
    assert len(out) == len(shape_list)
    for n, (grad, var) in enumerate(out):
        assert var is variables[n]
        torch.testing.assert_close(grad, _oracle(all_grads, n, average), rtol=0, atol=0)


def test_aggregate_grads_single_device_and_errors():
    pairs = [[(torch.ones(2), "v")]]
    assert aggregate_grads(pairs) == pairs[0]
    with pytest.raises(ValueError, match="not both"):
        aggregate_grads(pairs * 2, colocation=True, devices=["cpu:0"])
    with pytest.raises(TypeError, match="variable 0 .*no `.device`"):
        aggregate_grads([[(torch.ones(2), "v")]] * 2, colocation=True)
    with pytest.raises(ValueError, match="devices.*empty"):
        aggregate_grads(pairs * 2, devices=[])


@FAST
@given(st.integers(1, 4), shapes, st.booleans(), st.booleans(), st.integers(0, 99))
def test_allreduce_grads_naive_equals_sum_oracle(num_devices, shape_list, average, use_devices, seed):
    all_grads = _grid(num_devices, shape_list, seed)
    out = allreduce_grads_naive(all_grads, devices=CPUS[:3] if use_devices else None, average=average)
    assert len(out) == len(shape_list)
    for n, grad in enumerate(out):
        expected = all_grads[0][n] if num_devices == 1 else _oracle(all_grads, n, average)
        torch.testing.assert_close(grad, expected, rtol=0, atol=0)


def test_allreduce_grads_naive_rejects_ragged():
    with pytest.raises(ValueError, match="lengths"):
        allreduce_grads_naive([[torch.zeros(1)], [torch.zeros(1), torch.zeros(1)]])


# --- placement ----------------------------------------------------------------------


def test_least_loaded_device_setter_balances_variables_and_sends_the_rest_to_worker():
    setter = LeastLoadedDeviceSetter("cuda:0", ["ps:0", "ps:1", "ps:2"])
    assert setter(torch.nn.Parameter(torch.zeros(10, 10))) == "ps:0"
    assert setter(torch.nn.Parameter(torch.zeros(50))) == "ps:1"
    assert setter(torch.zeros(1000)) == "cuda:0"  # not a variable: no load added
    assert setter.place_with_balance((4, 5)) == "ps:2"
    assert setter.place_with_balance(40) == "ps:2"  # 20 < 50 < 100
    assert setter(torch.zeros(7), is_variable=True) == "ps:1"
    assert setter.ps_sizes == [100, 57, 60]


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: LeastLoadedDeviceSetter("cpu:0", []), ValueError, "ps_devices.*non-empty"),
        (lambda: LeastLoadedDeviceSetter("cpu:0", "ps:0"), ValueError, "ps_devices.*non-empty"),
        (lambda: LeastLoadedDeviceSetter("cpu:0", ["ps:0"]).place_with_balance(-3), ValueError, "var.*>= 0"),
        (lambda: LeastLoadedDeviceSetter("cpu:0", ["ps:0"]).place_with_balance("w"), TypeError, "var"),
        (lambda: OverrideCachingDevice(["cpu:0"], "cpu:0", -1), ValueError, "small_variable_size_threshold"),
    ],
)
def test_placement_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_override_caching_device_small_large_and_untrainable():
    chooser = OverrideCachingDevice(["cuda:0", "cuda:1"], "cpu:0", small_variable_size_threshold=64)
    assert chooser(torch.zeros(8)) == "cpu:0"
    assert chooser(torch.zeros(100)) == "cuda:0"
    assert chooser((10, 10)) == "cuda:1"
    assert chooser(1000) == "cuda:0"
    assert chooser(torch.zeros(100), trainable=False) is None
    assert chooser(64) == "cuda:1"
    assert chooser.sizes == [1100, 164]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices for in-process NCCL")
def test_allreduce_grads_nccl_on_two_gpus():
    all_grads = [[torch.randn(5, 3, device=f"cuda:{k}")] for k in range(2)]
    out = allreduce_grads(all_grads, average=True, mode="nccl")
    expected = (all_grads[0][0] + all_grads[1][0].to("cuda:0")) / 2
    for k in range(2):
        assert out[k][0].device == torch.device(f"cuda:{k}")
        torch.testing.assert_close(out[k][0].to("cuda:0"), expected)
