"""Tests for unison._collectives.transport.packing."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from unison._collectives.compat.tensorpack import GradientPacker
from unison._collectives.transport.packing import (
    TensorPacker,
    flatten_tensors,
    group_by_size,
    split_evenly,
    split_sizes,
    unflatten_tensors,
)

FAST = settings(max_examples=60)
DTYPES = [torch.float32, torch.float64, torch.float16, torch.int32, torch.int64]


def _random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-50, 50, shape, generator=gen).to(dtype)


shapes = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)
tensor_specs = st.lists(st.tuples(shapes, st.sampled_from(DTYPES)), min_size=1, max_size=6)


# --- group_by_size -----------------------------------------------------------------


@FAST
@given(st.lists(st.integers(0, 1000), max_size=30), st.integers(1, 3000))
def test_group_by_size_partitions_in_order_and_closes_at_threshold(sizes, threshold):
    groups = group_by_size(sizes, threshold)
    assert [i for g in groups for i in g] == list(range(len(sizes)))
    assert all(groups), "no empty groups"
    for group in groups[:-1]:
        assert sum(sizes[i] for i in group) >= threshold
    for group in groups:
        # A group closes as soon as it reaches the threshold, so without its last member it was below.
        assert sum(sizes[i] for i in group[:-1]) < threshold


@FAST
@given(st.lists(st.integers(0, 1000), max_size=10), st.integers(-5, 0))
def test_group_by_size_non_positive_threshold_is_one_group(sizes, threshold):
    assert group_by_size(sizes, threshold) == ([list(range(len(sizes)))] if sizes else [])


def test_group_by_size_counts_tensor_bytes():
    tensors = [torch.zeros(4), torch.zeros(2, dtype=torch.float64), torch.zeros(8, dtype=torch.int8), torch.zeros(1)]
    # bytes: 16, 16, 8, 4
    assert group_by_size(tensors, 16) == [[0], [1], [2, 3]]
    assert group_by_size(tensors, 32) == [[0, 1], [2, 3]]
    assert group_by_size([], 16) == []


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        (([3, -1], 4), ValueError, r"tensors_or_sizes\[1\].*>= 0"),
        (([3, 1.5], 4), TypeError, r"tensors_or_sizes\[1\].*int"),
        (([True], 4), TypeError, r"tensors_or_sizes\[0\]"),
        (([3], 4.0), TypeError, r"bytes_per_pack.*int"),
        ((torch.zeros(3), 4), TypeError, r"not one tensor"),
        (([torch.zeros(3).to_sparse()], 4), TypeError, r"sparse"),
    ],
)
def test_group_by_size_rejects_bad_input(args, error, match):
    with pytest.raises(error, match=match):
        group_by_size(*args)


# --- split_sizes / split_evenly ----------------------------------------------------


@FAST
@given(st.integers(0, 500), st.integers(1, 20))
def test_split_sizes_follow_tf_rule(total, num_packs):
    sizes = split_sizes(total, num_packs)
    assert sum(sizes) == total
    assert len(sizes) == max(1, min(num_packs, total))
    assert len(set(sizes[:-1])) <= 1
    assert all(s > 0 for s in sizes) or total == 0
    assert sizes[-1] >= sizes[0]


def test_split_sizes_examples_and_errors():
    assert split_sizes(10, 4) == [2, 2, 2, 4]
    assert split_sizes(3, 8) == [1, 1, 1]
    assert split_sizes(0, 3) == [0]
    with pytest.raises(ValueError, match="num_packs"):
        split_sizes(10, 0)
    with pytest.raises(ValueError, match="total"):
        split_sizes(-1, 2)


@FAST
@given(st.integers(0, 50), st.integers(0, 10))
def test_split_evenly_covers_indices_in_order(n_items, num_packs):
    groups = split_evenly(n_items, num_packs)
    assert [i for g in groups for i in g] == list(range(n_items))
    assert all(groups)
    if num_packs == 0:
        assert all(len(g) == 1 for g in groups)
    elif n_items:
        assert len(groups) == min(num_packs, n_items)


def test_split_evenly_rejects_negative():
    with pytest.raises(ValueError, match="num_packs.*>= 0"):
        split_evenly(4, -1)
    with pytest.raises(ValueError, match="n_items"):
        split_evenly(-4, 1)


# --- flatten / unflatten ------------------------------------------------------------


@FAST
@given(st.lists(shapes, min_size=1, max_size=6), st.sampled_from(DTYPES), st.integers(0, 2**16))
def test_flatten_unflatten_round_trip(shape_list, dtype, seed):
    tensors = [_random_tensor(s, dtype, seed + i) for i, s in enumerate(shape_list)]
    flat = flatten_tensors(tensors)
    assert flat.dim() == 1 and flat.numel() == sum(t.numel() for t in tensors)
    back = unflatten_tensors(flat, tensors)
    for original, restored in zip(tensors, back):
        assert restored.shape == original.shape and restored.dtype == original.dtype
        assert torch.equal(restored, original)


def test_flatten_copies_and_unflatten_views():
    a, b = torch.ones(2, 3), torch.arange(4.0)
    flat = flatten_tensors([a])
    flat.zero_()
    assert torch.equal(a, torch.ones(2, 3)), "flat buffer must not alias the input"
    flat = flatten_tensors([a, b])
    views = unflatten_tensors(flat, [a.shape, b.shape])
    flat.add_(1)
    assert torch.equal(views[1], b + 1), "unflattened tensors are views of the buffer"


def test_flatten_and_unflatten_errors():
    with pytest.raises(ValueError, match="non-empty"):
        flatten_tensors([])
    with pytest.raises(ValueError, match=r"tensors\[1\].*one dtype"):
        flatten_tensors([torch.zeros(2), torch.zeros(2, dtype=torch.float64)])
    with pytest.raises(ValueError, match=r"tensors\[1\].*one device"):
        flatten_tensors([torch.zeros(2), torch.zeros(2, device="meta")])
    with pytest.raises(TypeError, match=r"tensors\[0\]"):
        flatten_tensors([[1.0, 2.0]])
    with pytest.raises(ValueError, match="needs a 1-D buffer of 6"):
        unflatten_tensors(torch.zeros(5), [(2, 3)])


# --- TensorPacker -------------------------------------------------------------------

packer_configs = st.one_of(
    st.integers(0, 4).map(lambda p: {"num_packs": p}),
    st.integers(-1, 200).map(lambda b: {"bytes_per_pack": b}),
)


@FAST
@given(tensor_specs, st.integers(1, 3), packer_configs, st.integers(0, 2**16))
def test_tensor_packer_round_trip_and_reduction(specs, num_devices, config, seed):
    device_tensors = [
        [_random_tensor(shape, dtype, seed + 31 * k + n) for n, (shape, dtype) in enumerate(specs)]
        for k in range(num_devices)
    ]
    packer = TensorPacker(**config)
    packs = packer.pack(device_tensors)
    assert len(packs) == num_devices
    assert len({len(p) for p in packs}) == 1
    for p in range(len(packs[0])):
        assert len({(t.shape, t.dtype) for t in (packs[k][p] for k in range(num_devices))}) == 1
        if config.get("num_packs") != 0:
            assert packs[0][p].dim() == 1
    # Round trip: unpack(pack(x)) == x, exactly.
    for originals, restored in zip(device_tensors, packer.unpack(packs)):
        for a, b in zip(originals, restored):
            assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    # Reducing packs then unpacking equals reducing each tensor.
    summed = [sum(packs[k][p] for k in range(num_devices)) for p in range(len(packs[0]))]
    for n, tensor in enumerate(packer.unpack([summed])[0]):
        assert torch.equal(tensor, sum(device_tensors[k][n] for k in range(num_devices)))


def test_tensor_packer_never_mixes_dtypes():
    tensors = [torch.zeros(3), torch.zeros(2, dtype=torch.int64), torch.zeros(5), torch.zeros(1, dtype=torch.int64)]
    packs = TensorPacker(num_packs=1).pack([tensors])[0]
    assert [(p.dtype, p.numel()) for p in packs] == [(torch.float32, 8), (torch.int64, 3)]
    packs = TensorPacker(bytes_per_pack=12).pack([tensors])[0]
    assert [(p.dtype, p.numel()) for p in packs] == [
        (torch.float32, 3),
        (torch.float32, 5),
        (torch.int64, 2),
        (torch.int64, 1),
    ]


def test_tensor_packer_packs_are_fresh_buffers_and_num_packs_zero_passes_through():
    tensors = [torch.ones(4), torch.ones(2, 2)]
    packs = TensorPacker(num_packs=2).pack([tensors])[0]
    for p in packs:
        p.zero_()
    assert all(torch.equal(t, torch.ones_like(t)) for t in tensors)
    packs = TensorPacker(num_packs=0).pack([tensors])[0]
    assert packs[0] is tensors[0] and packs[1] is tensors[1]


def test_tensor_packer_errors():
    with pytest.raises(ValueError, match="not both"):
        TensorPacker(num_packs=1, bytes_per_pack=10)
    with pytest.raises(ValueError, match="num_packs.*>= 0"):
        TensorPacker(num_packs=-1)
    packer = TensorPacker(num_packs=2)
    with pytest.raises(RuntimeError, match="prior TensorPacker.pack"):
        packer.unpack([[torch.zeros(1)]])
    with pytest.raises(ValueError, match=r"device_tensors\[1\]\[0\].*\(3,\)"):
        packer.pack([[torch.zeros(2)], [torch.zeros(3)]])
    with pytest.raises(ValueError, match="lengths"):
        packer.pack([[torch.zeros(2)], []])
    packer.pack([[torch.zeros(20)]])
    with pytest.raises(ValueError, match=r"device_packs\[0\]. has 1 packs but pack\(\) produced 2"):
        packer.unpack([[torch.zeros(20)]])


# --- GradientPacker -----------------------------------------------------------------


def _grads(seed: int, dtype=torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(dtype) for s in [(64, 64), (64,), (32, 32, 3), (5,)]]


def test_gradient_packer_compute_strategy_decisions():
    # 4096 + 64 + 3072 + 5 = 7237 elements: >= 1024 per split with 4 splits, not with 8.
    assert GradientPacker(num_split=4).compute_strategy(_grads(0)) is True
    assert GradientPacker(num_split=8).compute_strategy(_grads(0)) is False
    mixed = _grads(0)
    mixed[1] = mixed[1].double()
    assert GradientPacker(num_split=2).compute_strategy(mixed) is False
    assert GradientPacker(num_split=1).compute_strategy([]) is False


def test_gradient_packer_reference_split_sizes_and_round_trip():
    packer = GradientPacker(num_split=3)
    grads = _grads(1)
    assert packer.compute_strategy(grads)
    packs = packer.pack(grads)
    total = sum(g.numel() for g in grads)
    assert [p.numel() for p in packs] == [total // 3, total // 3, total - 2 * (total // 3)]
    for a, b in zip(grads, packer.unpack(packs)):
        assert torch.equal(a, b)


def test_gradient_packer_pack_all_unpack_all_sum_oracle():
    devices = ["cpu:0", "cpu:1", "/device:CPU:2"]
    all_grads = [_grads(seed) for seed in range(3)]
    packer = GradientPacker(num_split=2)
    assert packer.compute_strategy(all_grads[0])
    packed = packer.pack_all(all_grads, devices)
    assert [len(p) for p in packed] == [2, 2, 2]
    summed = [sum(packed[k][s] for k in range(3)) for s in range(2)]
    unpacked = packer.unpack_all([summed] * 3, devices)
    for k in range(3):
        for n, g in enumerate(unpacked[k]):
            assert g.device == torch.device("cpu")
            torch.testing.assert_close(g, sum(all_grads[j][n] for j in range(3)), rtol=0, atol=0)


def test_gradient_packer_errors():
    with pytest.raises(ValueError, match="num_split.*>= 1"):
        GradientPacker(num_split=0)
    packer = GradientPacker(num_split=2)
    with pytest.raises(RuntimeError, match="compute_strategy"):
        packer.pack(_grads(0))
    assert packer.compute_strategy(_grads(0))
    with pytest.raises(RuntimeError, match="only once"):
        packer.compute_strategy(_grads(0))
    bad = _grads(0)
    bad[2] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"grads\[2\].*\(3,\)"):
        packer.pack(bad)
    with pytest.raises(ValueError, match="one device per gradient list"):
        packer.pack_all([_grads(0)], ["cpu:0", "cpu:1"])
    skipped = GradientPacker(num_split=8)
    assert not skipped.compute_strategy([torch.zeros(4)])
    with pytest.raises(RuntimeError, match="returned True"):
        skipped.pack([torch.zeros(4)])
