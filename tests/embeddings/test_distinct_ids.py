"""Distinct ids through numpy's sort: the same answer as ``torch.unique``, on either side of the switch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from unison._embeddings.tables import distinct_ids as d

pytestmark = pytest.mark.timeout(60)


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    """``n`` int64 ids over the whole range, a third of them repeats."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(-(2**62), 2**62, (n,), generator=gen)
    repeats = len(ids[1::3])
    ids[0:3 * repeats:3] = ids[1::3]
    return ids


def _assert_same(got: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...]) -> None:
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == e.dtype and g.shape == e.shape
        assert torch.equal(g, e)


@pytest.mark.parametrize("n", [0, 1, 7, d.NUMPY_FROM, d.NUMPY_FROM + 1, 6656, 40_000])
def test_equal_to_torch_unique_below_and_above_the_switch(n):
    ids = _ids(n)
    _assert_same(d.distinct_ids(ids), torch.unique(ids, return_inverse=True))
    _assert_same(d.distinct_ids_and_counts(ids), torch.unique(ids, return_inverse=True, return_counts=True))


def test_the_numpy_sort_is_taken_above_the_switch_only(monkeypatch):
    taken = []
    original = d._by_numpy
    monkeypatch.setattr(d, "_by_numpy", lambda ids: taken.append(ids.numel()) or original(ids))
    d.distinct_ids(_ids(d.NUMPY_FROM))
    d.distinct_ids(_ids(d.NUMPY_FROM + 1))
    d.distinct_ids(_ids(5000).to(torch.int32))  # other dtypes keep torch's
    assert taken == [d.NUMPY_FROM + 1]


def test_inverse_keeps_the_shape_of_ids_and_strided_ids_are_read_as_they_look():
    ids = _ids(3 * 4000).reshape(3, 4000)
    _assert_same(d.distinct_ids(ids), torch.unique(ids, return_inverse=True))
    strided = ids.t()  # not contiguous: numpy reads the view's own order
    _assert_same(d.distinct_ids_and_counts(strided), torch.unique(strided, return_inverse=True, return_counts=True))


def test_extreme_and_all_equal_ids():
    ids = torch.tensor([2**63 - 1, -(2**63), 0, -1] * 1000)
    _assert_same(d.distinct_ids_and_counts(ids), torch.unique(ids, return_inverse=True, return_counts=True))
    same = torch.full((5000,), 42, dtype=torch.int64)
    unique, inverse, counts = d.distinct_ids_and_counts(same)
    assert unique.tolist() == [42] and counts.tolist() == [5000] and not inverse.any()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-(2**63), 2**63 - 1) | st.integers(0, 50), max_size=300))
def test_any_ids_through_the_numpy_sort(values):
    ids = torch.tensor(values, dtype=torch.int64)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(d, "NUMPY_FROM", 0)  # every size through numpy's sort (empty lists stay torch's)
        got = d.distinct_ids_and_counts(ids)
    _assert_same(got, torch.unique(ids, return_inverse=True, return_counts=True))
