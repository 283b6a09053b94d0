"""PackedAllReduce in one process: a fake collective (doubling each pack) stands in for gloo.

Doubling is what a SUM over two workers holding equal tensors gives, so every result
must be twice its input, in input order and shape, whatever the packing did.
"""

from __future__ import annotations

import pytest
import torch

from unison._collectives.group.worker_control import layout_crc as _layout_crc
from unison._collectives.transport.packed_all_reduce import LANE_SPLIT_BYTES, PackedAllReduce, _lanes

CPU = torch.device("cpu")


class FakeCollective:
    """Records launched packs (as copies taken at launch) and doubles them in place."""

    def __init__(self) -> None:
        self.launched: list[torch.Tensor] = []
        self.waited = 0

    def launch(self, pack: torch.Tensor) -> torch.Tensor:
        self.launched.append(pack.clone())
        pack.mul_(2)
        return pack

    def wait(self, work: torch.Tensor) -> None:
        self.waited += 1


def reduce(packed: PackedAllReduce, tensors, divisor: int = 1):
    fake = FakeCollective()
    return packed(tensors, CPU, fake.launch, fake.wait, divisor), fake


def mixed_tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(5, generator=g),
        torch.randn(3, 4, generator=g),
        torch.tensor(2.5),  # 0-d, like a loss
        torch.arange(6, dtype=torch.int64),
        torch.randn(4, 3, generator=g, dtype=torch.float64).t(),  # non-contiguous
        torch.randn(2, 2, 2, generator=g),
    ]


def test_results_are_sums_in_input_order_shape_and_dtype_and_inputs_are_untouched():
    tensors = mixed_tensors()
    before = [t.clone() for t in tensors]
    results, fake = reduce(PackedAllReduce(0), tensors)
    for got, t, original in zip(results, tensors, before):
        assert got.shape == t.shape and got.dtype == t.dtype
        assert torch.equal(got, original * 2)
        assert torch.equal(t, original)
    assert len(fake.launched) == 3  # one pack per dtype: float32, int64, float64
    assert fake.waited == 3


def test_packs_hold_the_last_tensors_first():
    tensors = [torch.full((2,), float(i)) for i in range(4)]
    _, fake = reduce(PackedAllReduce(0), tensors)
    assert fake.launched[0].tolist() == [3.0, 3.0, 2.0, 2.0, 1.0, 1.0, 0.0, 0.0]


def test_mean_divides_floats_in_place_and_integers_into_new_tensors():
    tensors = mixed_tensors()
    results, _ = reduce(PackedAllReduce(0), tensors, divisor=2)
    for got, t in zip(results, tensors):
        assert torch.allclose(got.double(), t.double())
    assert results[3].dtype == torch.float32  # integer mean: true division, as `tensor / divisor`


def test_bytes_per_pack_cuts_packs_at_tensor_boundaries():
    tensors = [torch.ones(25) for _ in range(10)]  # 100 bytes each
    results, fake = reduce(PackedAllReduce(bytes_per_pack=300), tensors)
    assert [p.numel() for p in fake.launched] == [75, 75, 75, 25]
    assert all(torch.equal(r, torch.full((25,), 2.0)) for r in results)


def test_a_large_buffer_travels_as_two_packs_when_unison_chooses():
    numel = LANE_SPLIT_BYTES // 4 // 8
    tensors = [torch.full((numel,), float(i)) for i in range(8)]
    results, fake = reduce(PackedAllReduce(0), tensors)
    assert [p.numel() for p in fake.launched] == [4 * numel, 4 * numel]
    assert fake.launched[0][0].item() == 7.0  # last tensor first
    assert all(torch.equal(r, torch.full((numel,), 2.0 * i)) for i, r in enumerate(results))
    just_below = [torch.ones(numel - 1) for _ in range(8)]
    _, fake = reduce(PackedAllReduce(0), just_below)
    assert len(fake.launched) == 1


@pytest.mark.parametrize(
    ("numels", "expected"),
    [([10], [(0, 1)]), ([1 << 22], [(0, 1)]), ([1 << 20] * 4, [(0, 2), (2, 4)]),
     ([3 << 20, 1 << 20, 1], [(0, 1), (1, 3)]), ([1 << 20, 3 << 20], [(0, 1), (1, 2)])],
)
def test_lanes_cut_near_the_middle_and_never_leave_a_lane_empty(numels, expected):
    assert _lanes(numels, 4, 0) == expected


def test_kept_results_are_never_overwritten_and_dropped_ones_are_reused():
    packed = PackedAllReduce(0)
    tensors = [torch.ones(4), torch.ones(3)]
    first, _ = reduce(packed, tensors)
    second, _ = reduce(packed, [t * 10 for t in tensors])
    assert torch.equal(first[0], torch.full((4,), 2.0))  # still holds the first call's sums
    assert first[0].untyped_storage().data_ptr() != second[0].untyped_storage().data_ptr()
    storage = second[0].untyped_storage().data_ptr()
    del first, second
    third, _ = reduce(packed, tensors)
    assert third[0].untyped_storage().data_ptr() == storage  # nothing held it: the pool reused it
    assert torch.equal(third[1], torch.full((3,), 2.0))


def test_a_result_saved_by_autograd_keeps_its_buffer():
    packed = PackedAllReduce(0)
    (scale,), _ = reduce(packed, [torch.full((3,), 1.0)])
    weight = torch.ones(3, requires_grad=True)
    loss = (weight * scale).sum()  # autograd saves `scale` for the backward of weight
    del scale
    reduce(packed, [torch.full((3,), 7.0)])
    loss.backward()
    assert torch.equal(weight.grad, torch.full((3,), 2.0))


def test_inputs_that_require_grad_are_reduced():
    weight = torch.ones(3, requires_grad=True)
    (result,), _ = reduce(PackedAllReduce(0), [weight * 3])
    assert torch.equal(result, torch.full((3,), 6.0)) and not result.requires_grad


def test_layout_crc_tells_shapes_dtypes_and_sparsity_apart():
    dense = [torch.zeros(2, 3), torch.zeros(4)]
    assert _layout_crc(dense) == _layout_crc([torch.ones(2, 3), torch.ones(4)])
    assert _layout_crc(dense) != _layout_crc([torch.zeros(3, 2), torch.zeros(4)])
    assert _layout_crc(dense) != _layout_crc([torch.zeros(2, 3, dtype=torch.float64), torch.zeros(4)])
    assert _layout_crc(dense) != _layout_crc([torch.zeros(4), torch.zeros(2, 3)])
    assert _layout_crc([torch.zeros(6)]) != _layout_crc([torch.zeros(2, 3)])
    assert _layout_crc([torch.zeros(2, 3)]) != _layout_crc([torch.zeros(2, 3).to_sparse()])
