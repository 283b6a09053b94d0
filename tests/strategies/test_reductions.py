"""Reductions: ReduceOp, strategy.reduce/gather, extended.reduce_to/batch_reduce_to,
ReplicaContext.all_reduce/all_gather."""

from __future__ import annotations

import pytest
import torch

import unison
from unison import Mirrored, PerReplica, ReduceOp, get_replica_context

pytestmark = pytest.mark.timeout(30)  # replicas are threads: a hung rendezvous fails the test


def _per_replica(strategy, make):
    """PerReplica built inside ``run``: ``make(replica_id)`` on each replica."""
    return strategy.run(lambda: make(get_replica_context().replica_id_in_sync_group))


# --- ReduceOp ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "member"),
    [("sum", ReduceOp.SUM), ("SUM", ReduceOp.SUM), ("Sum", ReduceOp.SUM),
     ("mean", ReduceOp.MEAN), ("MEAN", ReduceOp.MEAN), ("mEaN", ReduceOp.MEAN)],
)
def test_reduce_op_from_string_any_case(name, member):
    assert ReduceOp.from_any(name) is member
    assert ReduceOp.from_any(member) is member


@pytest.mark.parametrize("bad", ["max", "", "avg", 0, None])
def test_wrong_reduce_op_raises(bad, mirrored2):
    message = rf"reduce_op {bad!r} is not a ReduceOp: use one of SUM, MEAN"
    with pytest.raises(ValueError, match=message):
        ReduceOp.from_any(bad)
    value = PerReplica([torch.ones(1), torch.ones(1)])
    with pytest.raises(ValueError, match=message):
        mirrored2.reduce(bad, value)
    with pytest.raises(ValueError, match=message):
        mirrored2.extended.reduce_to(bad, value, "cpu:0")
    with pytest.raises(ValueError, match=message):
        mirrored2.extended.batch_reduce_to(bad, [(value, "cpu:0")])


def test_wrong_reduce_op_in_all_reduce_raises_in_the_caller(mirrored2, thread_baseline):
    with pytest.raises(ValueError, match=r"reduce_op 'prod' is not a ReduceOp"):
        mirrored2.run(lambda: get_replica_context().all_reduce("prod", torch.ones(1)))


# --- strategy.reduce -------------------------------------------------------------------


@pytest.mark.parametrize("op", [ReduceOp.SUM, "sum", "SUM"])
def test_reduce_sum(mirrored2, op):
    value = _per_replica(mirrored2, lambda i: torch.tensor([1.0, 2.0]) * (i + 1))
    out = mirrored2.reduce(op, value)
    assert torch.equal(out, torch.tensor([3.0, 6.0]))
    assert out.device == torch.device("cpu")


@pytest.mark.parametrize("op", [ReduceOp.MEAN, "mean", "Mean"])
def test_reduce_mean(mirrored2, op):
    value = _per_replica(mirrored2, lambda i: torch.tensor([1.0, 2.0]) * (i + 1))
    assert torch.equal(mirrored2.reduce(op, value), torch.tensor([1.5, 3.0]))


def test_reduce_with_axis_sum_and_mean():
    strategy = unison.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"])
    value = PerReplica([torch.arange(6.0).reshape(2, 3) + 10 * i for i in range(3)])
    stacked = torch.cat(value.values, dim=0)
    # SUM over axis 0 of every replica = sum over the concatenation along that axis
    assert torch.allclose(strategy.reduce("sum", value, axis=0), stacked.sum(dim=0))
    # MEAN over axis 0: the mean over all rows of all replicas (TF semantics)
    assert torch.allclose(strategy.reduce("mean", value, axis=0), stacked.mean(dim=0))
    assert torch.allclose(strategy.reduce(ReduceOp.SUM, value, axis=1),
                          sum(c.sum(dim=1) for c in value.values))
    assert torch.allclose(strategy.reduce(ReduceOp.MEAN, value, axis=1),
                          sum(c.sum(dim=1) for c in value.values) / 9)


def test_reduce_mean_with_axis_uneven_batches():
    strategy = unison.MirroredStrategy(["cpu:0", "cpu:1"])
    value = PerReplica([torch.tensor([1.0, 2.0, 3.0]), torch.tensor([10.0, 20.0, 30.0])])
    assert strategy.reduce("mean", value, axis=0).item() == pytest.approx(66.0 / 6)


def test_reduce_of_plain_value_one_replica(one_device):
    out = one_device.reduce("sum", torch.tensor([1.0, 2.0]))
    assert torch.equal(out, torch.tensor([1.0, 2.0]))
    assert torch.equal(one_device.reduce("mean", torch.tensor([4.0]), axis=0), torch.tensor(4.0))


def test_reduce_sum_of_non_distributed_value_over_replicas_raises(mirrored2):
    with pytest.raises(ValueError, match=r"cannot be reduced with ReduceOp.SUM over 2 replicas: it is one value"):
        mirrored2.reduce("sum", torch.ones(2))
    # MEAN of one value is that value, as in TF
    assert torch.equal(mirrored2.reduce("mean", torch.ones(2)), torch.ones(2))


@pytest.mark.parametrize(
    ("shapes", "dtypes", "detail"),
    [
        ([(2,), (3,)], [torch.float32] * 2,
         r"replica 0 has shape \(2,\) and dtype torch.float32, replica 1 has shape \(3,\)"),
        ([(2, 1), (1, 2)], [torch.float32] * 2, r"replica 1 has shape \(1, 2\)"),
        ([(2,), (2,)], [torch.float32, torch.float64], r"replica 1 has shape \(2,\) and dtype torch.float64"),
    ],
)
def test_reduce_of_mismatched_per_replica_raises(mirrored2, shapes, dtypes, detail):
    value = PerReplica([torch.ones(s, dtype=d) for s, d in zip(shapes, dtypes)])
    match = r"cannot reduce per-replica tensors of different layouts: .*" + detail
    with pytest.raises(ValueError, match=match):
        mirrored2.reduce("sum", value)
    with pytest.raises(ValueError, match=match):
        mirrored2.extended.reduce_to("mean", value, ["cpu:0", "cpu:1"])


def test_all_reduce_of_mismatched_shapes_raises_without_hang(mirrored2, thread_baseline):
    def fn():
        i = get_replica_context().replica_id_in_sync_group
        return get_replica_context().all_reduce("sum", torch.ones(i + 1))

    with pytest.raises(ValueError, match=r"different layouts: replica 0 has shape \(1,\).*replica 1 has shape \(2,\)"):
        mirrored2.run(fn)


def test_reduce_of_non_tensor_components_raises(mirrored2):
    with pytest.raises(TypeError, match=r"cannot reduce replica 0's value of type str"):
        mirrored2.reduce("sum", PerReplica(["a", "b"]))


# --- gather / local results ----------------------------------------------------------------


def test_gather_concatenates_along_axis(mirrored2):
    value = _per_replica(mirrored2, lambda i: torch.full((2, 3), float(i)))
    out = mirrored2.gather(value, axis=0)
    assert out.shape == (4, 3)
    assert torch.equal(out, torch.cat([torch.zeros(2, 3), torch.ones(2, 3)]))
    assert mirrored2.gather(value, axis=1).shape == (2, 6)


def test_gather_one_device(one_device):
    assert torch.equal(one_device.gather(torch.arange(3), axis=0), torch.arange(3))


def test_experimental_local_results(mirrored2):
    value = _per_replica(mirrored2, lambda i: torch.tensor(float(i)))
    results = mirrored2.experimental_local_results(value)
    assert isinstance(results, tuple)
    assert [r.item() for r in results] == [0.0, 1.0]
    plain = torch.tensor(5.0)
    assert mirrored2.experimental_local_results(plain) == (plain,)
    with mirrored2.scope():
        v = unison.Variable(3.0)
    assert [c.item() for c in mirrored2.experimental_local_results(v)] == [3.0, 3.0]


def test_num_replicas_in_sync(mirrored2, central2, one_device):
    assert mirrored2.num_replicas_in_sync == 2
    assert central2.num_replicas_in_sync == 2
    assert one_device.num_replicas_in_sync == 1
    assert unison.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"]).num_replicas_in_sync == 3


# --- extended.reduce_to / batch_reduce_to ------------------------------------------------


def test_reduce_to_one_device_gives_tensor(mirrored2):
    value = PerReplica([torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])])
    out = mirrored2.extended.reduce_to("sum", value, "cpu:0")
    assert isinstance(out, torch.Tensor)
    assert torch.equal(out, torch.tensor([4.0, 6.0]))
    # a tensor as destination means its device
    assert torch.equal(mirrored2.extended.reduce_to("mean", value, torch.zeros(1)), torch.tensor([2.0, 3.0]))


def test_reduce_to_value_itself_is_an_all_reduce(mirrored2):
    value = PerReplica([torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])])
    out = mirrored2.extended.reduce_to(ReduceOp.SUM, value, value)
    assert isinstance(out, Mirrored)
    assert [t.tolist() for t in out.values] == [[4.0, 6.0], [4.0, 6.0]]
    assert out.values[0].data_ptr() != out.values[1].data_ptr()  # one copy per device
    assert value.values[0].tolist() == [1.0, 2.0]  # inputs untouched


def test_reduce_to_variable_destination(mirrored2):
    with mirrored2.scope():
        v = unison.Variable(0.0)
    value = PerReplica([torch.tensor(1.0), torch.tensor(2.0)])
    out = mirrored2.extended.reduce_to("mean", value, v)
    assert isinstance(out, Mirrored)
    assert [t.item() for t in out.values] == [1.5, 1.5]
    assert [c.item() for c in v.values] == [0.0, 0.0]  # reduce_to does not update the variable


def test_batch_reduce_to(mirrored2):
    a = PerReplica([torch.tensor([1.0]), torch.tensor([2.0])])
    b = PerReplica([torch.ones(2, 2), 3 * torch.ones(2, 2)])
    out_a, out_b, out_c = mirrored2.extended.batch_reduce_to(
        "sum", [(a, "cpu:0"), (b, ["cpu:0", "cpu:1"]), (a, a)]
    )
    assert torch.equal(out_a, torch.tensor([3.0]))
    assert isinstance(out_b, Mirrored) and all(torch.equal(t, 4 * torch.ones(2, 2)) for t in out_b.values)
    assert [t.item() for t in out_c.values] == [3.0, 3.0]
    out = mirrored2.extended.batch_reduce_to("mean", [(a, "cpu:0"), (b, "cpu:1")])
    assert out[0].item() == 1.5 and torch.equal(out[1], 2 * torch.ones(2, 2))
    assert mirrored2.extended.batch_reduce_to("sum", []) == []


def test_reduce_to_bad_destination_raises(mirrored2):
    value = PerReplica([torch.tensor(1.0), torch.tensor(2.0)])
    with pytest.raises(ValueError, match=r"destinations 42 name no device"):
        mirrored2.extended.reduce_to("sum", value, 42)
    with pytest.raises(ValueError, match=r"device 'nowhere' is not a device name"):
        mirrored2.extended.reduce_to("sum", value, "nowhere")


# --- ReplicaContext.all_reduce / all_gather -----------------------------------------------


@pytest.mark.parametrize(("op", "expected"), [("sum", 3.0), (ReduceOp.MEAN, 1.5)])
def test_all_reduce_tensor(mirrored2, op, expected, thread_baseline):
    def fn():
        i = get_replica_context().replica_id_in_sync_group
        return get_replica_context().all_reduce(op, torch.tensor([float(i + 1), 10.0 * (i + 1)]))

    out = mirrored2.experimental_local_results(mirrored2.run(fn))
    assert [t.tolist() for t in out] == [[expected, 10 * expected]] * 2


def test_all_reduce_nested_structure(mirrored2):
    def fn():
        i = float(get_replica_context().replica_id_in_sync_group)
        value = {"a": torch.tensor(i), "b": (torch.full((2,), i + 1), [torch.tensor([[i, 2 * i]])])}
        out = get_replica_context().all_reduce("sum", value)
        assert isinstance(out, dict) and isinstance(out["b"], tuple) and isinstance(out["b"][1], list)
        return out

    out = mirrored2.run(fn)
    local = mirrored2.experimental_local_results
    assert [t.item() for t in local(out["a"])] == [1.0, 1.0]
    assert [t.tolist() for t in local(out["b"][0])] == [[3.0, 3.0]] * 2
    assert [t.tolist() for t in local(out["b"][1][0])] == [[[1.0, 2.0]]] * 2


def test_all_reduce_empty_structure(mirrored2):
    out = mirrored2.run(lambda: get_replica_context().all_reduce("sum", ()))
    assert out == ()


def test_all_reduce_one_device(one_device):
    out = one_device.run(lambda: get_replica_context().all_reduce("sum", {"x": torch.tensor(2.0)}))
    assert out["x"].item() == 2.0


def test_all_gather(mirrored2):
    def fn():
        i = get_replica_context().replica_id_in_sync_group
        return get_replica_context().all_gather(torch.full((1, 2), float(i)), axis=0)

    out = mirrored2.experimental_local_results(mirrored2.run(fn))
    assert [t.tolist() for t in out] == [[[0.0, 0.0], [1.0, 1.0]]] * 2


def test_all_gather_nested_along_axis_1(mirrored2):
    def fn():
        i = get_replica_context().replica_id_in_sync_group
        return get_replica_context().all_gather({"x": torch.full((2, 1), float(i))}, axis=1)

    out = mirrored2.experimental_local_results(mirrored2.run(fn)["x"])
    assert [t.tolist() for t in out] == [[[0.0, 1.0], [0.0, 1.0]]] * 2
