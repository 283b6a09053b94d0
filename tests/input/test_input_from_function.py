"""distribute_datasets_from_function: one pipeline per worker or per replica."""

import pytest
import torch

from unison import DistributedDatasetsFromFunction, InputContext, InputOptions
from unison._values.values import PerReplica


def per_replica_batches(ctx, total=12, per_replica=2):
    """The pipeline's share of samples 0..total-1 (by pipeline id), batched per replica."""
    ids = torch.arange(total)[ctx.input_pipeline_id :: ctx.num_input_pipelines]
    return [ids[i : i + per_replica] for i in range(0, len(ids), per_replica)]


def test_per_worker_calls_dataset_fn_once_and_deals_batches_to_replicas():
    contexts = []

    def dataset_fn(ctx):
        contexts.append(ctx)
        return per_replica_batches(ctx, total=14)

    d = DistributedDatasetsFromFunction(dataset_fn, devices=["cpu:0", "cpu:1"], num_workers=2, worker_index=1)
    assert contexts == [InputContext(2, 1, 4)] and d.input_contexts == (InputContext(2, 1, 4),)
    steps = [[t.tolist() for t in s.values] for s in d]
    # Worker 1 keeps ids 1, 3, ..., 13 in batches of 2: [1,3] [5,7] | [9,11] [13] | [] (filled).
    assert steps == [[[1, 3], [5, 7]], [[9, 11], [13]]]
    assert contexts == [InputContext(2, 1, 4)]  # iterating does not call dataset_fn again
    assert [[t.tolist() for t in s.values] for s in d] == steps  # a list is re-iterable


def test_per_worker_odd_batch_count_gives_the_last_replica_an_empty_batch():
    d = DistributedDatasetsFromFunction(lambda ctx: [torch.arange(2), torch.arange(2, 4), torch.arange(4, 6)],
                                        devices=["cpu:0", "cpu:1"])
    last = list(d)[-1]
    assert last.values[0].tolist() == [4, 5] and last.values[1].shape == (0,)


def test_a_batch_object_repeated_by_the_pipeline_is_still_per_replica():
    batch = {"x": torch.ones(2)}
    (step,) = list(DistributedDatasetsFromFunction(lambda ctx: [batch, batch], devices=["cpu:0", "cpu:1"]))
    assert isinstance(step["x"], PerReplica) and len(step["x"].values) == 2


def test_per_replica_builds_one_pipeline_per_replica():
    options = InputOptions(experimental_replication_mode="per_replica")
    d = DistributedDatasetsFromFunction(per_replica_batches, devices=["cpu:0", "cpu:1"], num_workers=2, worker_index=1,
                                        options=options)
    assert d.input_contexts == (InputContext(4, 2, 4), InputContext(4, 3, 4))
    steps = [[t.tolist() for t in s.values] for s in d]
    assert steps == [[[2, 6], [3, 7]], [[10], [11]]]


def test_single_replica_yields_the_batch_itself():
    d = DistributedDatasetsFromFunction(lambda ctx: [{"x": torch.ones(2, 3)}], devices=["cpu:0"])
    (step,) = list(d)
    assert isinstance(step, dict) and step["x"].shape == (2, 3)


def test_workers_with_different_lengths_stop_together(helpers):
    agree = helpers.ThreadAgree(2)

    def worker(w):
        d = DistributedDatasetsFromFunction(
            lambda ctx: [torch.arange(2)] * (3 + 2 * ctx.input_pipeline_id),
            devices=["cpu:0"],
            num_workers=2,
            worker_index=w,
            agree=agree.for_worker(w),
        )
        return len(list(d))

    with pytest.warns(UserWarning, match=r"worker 1 stops at step 3 with input left, because another worker ran out"):
        counts = helpers.run_threads([lambda: worker(0), lambda: worker(1)])
    assert counts == [3, 3]
    assert agree.calls == [4, 4]  # three steps with data, then one that ends the loop on both


def test_set_epoch_reaches_each_pipelines_sampler():
    samplers = []

    def dataset_fn(ctx):
        data = torch.utils.data.TensorDataset(torch.arange(8))
        sampler = torch.utils.data.DistributedSampler(data, num_replicas=ctx.num_input_pipelines,
                                                      rank=ctx.input_pipeline_id, seed=1)
        samplers.append(sampler)
        return torch.utils.data.DataLoader(data, batch_size=ctx.get_per_replica_batch_size(4), sampler=sampler)

    d = DistributedDatasetsFromFunction(dataset_fn, devices=["cpu:0"], num_workers=2, worker_index=0)
    d.set_epoch(5)
    assert [s.epoch for s in samplers] == [5]


@pytest.mark.parametrize(
    ("fn", "error", "match"),
    [
        (lambda ctx: torch.utils.data.TensorDataset(torch.arange(4)), TypeError,
         r"dataset_fn returned a map-style TensorDataset for InputContext\(.*\), which yields samples: "
         r"return a DataLoader"),
        (lambda ctx: torch.arange(4), TypeError,
         r"dataset_fn returned Tensor for InputContext.*return an iterable of per-replica batches"),
        (lambda ctx: None, TypeError, r"dataset_fn returned NoneType"),
        ("not callable", TypeError, r"`dataset_fn` must be callable, got str"),
    ],
)
def test_bad_dataset_fn(fn, error, match):
    with pytest.raises(error, match=match):
        DistributedDatasetsFromFunction(fn, devices=["cpu:0"])


def test_pipelines_with_different_structures_are_rejected():
    options = InputOptions(experimental_replication_mode="per_replica")
    d = DistributedDatasetsFromFunction(
        lambda ctx: [torch.ones(2)] if ctx.input_pipeline_id == 0 else [(torch.ones(2),)],
        devices=["cpu:0", "cpu:1"],
        options=options,
    )
    with pytest.raises(ValueError, match=r"per-replica batch at step 0 of local input pipeline 1 has structure "
                                         r"\(Tensor,\), but the first per-replica batch had Tensor"):
        list(d)
