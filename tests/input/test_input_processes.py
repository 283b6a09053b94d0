"""Input distribution across real worker processes."""

from __future__ import annotations

import warnings

import pytest

from tests.multi_worker import _workers as w
from unison._testing import run_workers


@pytest.mark.timeout(90)
def test_input_path_matches_single_device():
    reference = w.single_device_weights()
    for weights, rows in run_workers(w.input_path_training, 2, timeout=60):
        assert rows == [32] * 20  # each worker gets half of every global batch of 64
        for got, want in zip(weights, reference):
            assert (got - want).abs().max().item() <= 1e-5


@pytest.mark.timeout(90)
def test_distribute_datasets_from_function_sees_each_pipeline_id():
    (seen0, steps0), (seen1, steps1) = run_workers(w.pipelines_from_function, 2, timeout=60)
    assert seen0 == [(0, 2, 4, 2)] and seen1 == [(1, 2, 4, 2)]
    assert len(steps0) == len(steps1) == 3  # worker 0 ran out first: both stop at its end
    assert steps0[0] == [[0, 1], [2, 3]] and steps1[0] == [[100, 101], [102, 103]]


@pytest.mark.timeout(90)
def test_uneven_file_shards_end_together():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (steps0, values0), (steps1, values1) = run_workers(w.file_shards_end_together, 2, timeout=60)
    assert steps0 == steps1
    # worker 0 reads files 1 and 3 (4 batches), worker 1 file 2 (2 batches); each global batch of 4
    # rows is cut into 2 steps of 2 rows, so worker 1 has 4 steps and both stop there.
    assert steps0 == 4
    assert all(v == 1.0 or v == 3.0 for step in values0 for v in step)
    assert all(v == 2.0 for step in values1 for v in step)
