"""Iteration: __next__, get_next_as_optional, agreement on the end, device placement."""

import pytest
import torch

from unison import DistributedDataset, DistributedDatasetsFromFunction, InputOptions, OptionalValue


def batches(*sizes):
    out, start = [], 0
    for size in sizes:
        out.append(torch.arange(start, start + size))
        start += size
    return out


def test_get_next_as_optional_until_the_end_and_after():
    it = iter(DistributedDataset(batches(2, 2), devices=["cpu:0"]))
    first = it.get_next_as_optional()
    assert first.has_value() and first.get_value().tolist() == [0, 1]
    assert next(it).tolist() == [2, 3]
    for _ in range(2):
        end = it.get_next_as_optional()
        assert not end.has_value()
    with pytest.raises(StopIteration):
        next(it)


def test_empty_optional_get_value_raises():
    with pytest.raises(ValueError, match=r"this OptionalValue is empty: check has_value\(\) before get_value\(\)"):
        OptionalValue.empty().get_value()
    assert repr(OptionalValue.from_value(3)) == "OptionalValue(3)"


def test_each_iter_is_a_new_pass_but_a_generator_gives_one():
    d = DistributedDataset(batches(2, 2), devices=["cpu:0"])
    assert [len(list(d)), len(list(d))] == [2, 2]
    once = DistributedDataset((b for b in batches(2, 2)), devices=["cpu:0"])
    assert len(list(once)) == 2
    with pytest.raises(ValueError, match=r"the dataset is a one-shot iterator \(e\.g\. a generator\) "
                                         r"that the previous pass consumed"):
        iter(once)


def recording_agree(answers=None):
    calls = []

    def agree(has_data):
        calls.append(has_data)
        return has_data if answers is None else answers(len(calls), has_data)

    return agree, calls


def test_agree_is_asked_once_per_step_where_workers_may_differ():
    agree, calls = recording_agree()
    gen = DistributedDataset((b for b in batches(4, 4)), devices=["cpu:0"], num_workers=2, agree=agree)
    assert len(list(gen)) == 2
    assert calls == [True, True, False]


def test_agree_is_not_asked_when_steps_are_known_to_match():
    agree, calls = recording_agree()
    assert len(list(DistributedDataset(batches(4, 4), devices=["cpu:0"], num_workers=2, agree=agree))) == 2
    assert len(list(DistributedDataset((b for b in batches(4)), devices=["cpu:0"], agree=agree))) == 1  # one worker
    assert calls == []


def test_stopping_early_because_another_worker_ran_out_warns():
    agree, calls = recording_agree(lambda n, has: has and n < 2)
    d = DistributedDatasetsFromFunction(lambda ctx: batches(2, 2, 2), devices=["cpu:0"], num_workers=2, agree=agree)
    it = iter(d)
    assert next(it).tolist() == [0, 1]
    with pytest.warns(UserWarning,
                      match=r"worker 0 stops at step 1 with input left, because another worker ran out") as record:
        assert not it.get_next_as_optional().has_value()
    assert record[0].filename == __file__
    assert not it.get_next_as_optional().has_value() and calls == [True, True]


def test_components_are_fetched_to_logical_cpu_devices_or_left_in_place():
    batch = torch.arange(4)
    (step,) = list(DistributedDataset([batch], devices=["cpu:0", "cpu:1"], options=InputOptions(pin_memory=True)))
    assert all(t.device == torch.device("cpu") and not t.is_pinned() for t in step.values)
    (kept,) = list(DistributedDataset([batch], devices=["cpu:0", "cpu:1"],
                                      options=InputOptions(experimental_fetch_to_device=False)))
    assert kept.values[0].data_ptr() == batch.data_ptr()  # a view of the host batch, no copy


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_components_move_to_cuda_with_pinned_memory():
    (step,) = list(DistributedDataset([{"x": torch.arange(4.0)}], devices=["cuda:0"],
                                      options=InputOptions(pin_memory=True)))
    assert step["x"].device == torch.device("cuda", 0)
    assert step["x"].cpu().tolist() == [0.0, 1.0, 2.0, 3.0]
