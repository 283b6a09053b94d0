"""In-process CrossDeviceOps: every algorithm against a plain-sum oracle, NCCL guards, selection rules."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import unison
from unison import (
    AllReduceCrossDeviceOps,
    HierarchicalCopyAllReduce,
    Mirrored,
    NcclAllReduce,
    PerReplica,
    ReduceOp,
    ReductionToOneDevice,
    select_cross_device_ops,
)

pytestmark = pytest.mark.timeout(30)  # in-process only; a regression that loops fails instead of hanging

FAST = settings(max_examples=25)

ALGORITHMS = {
    "reduction_to_one_device": ReductionToOneDevice,
    "hierarchical_copy": HierarchicalCopyAllReduce,
    "hierarchical_copy_3_packs": lambda: HierarchicalCopyAllReduce(num_packs=3),
    "all_reduce_0_packs": lambda: AllReduceCrossDeviceOps(num_packs=0),
    "all_reduce_1_pack": lambda: AllReduceCrossDeviceOps(num_packs=1),
    "all_reduce_3_packs": lambda: AllReduceCrossDeviceOps(num_packs=3),
    "all_reduce_hierarchical_0_packs": lambda: AllReduceCrossDeviceOps("hierarchical_copy", num_packs=0),
    "all_reduce_hierarchical_3_packs": lambda: AllReduceCrossDeviceOps("hierarchical_copy", num_packs=3),
}

shape_lists = st.lists(st.lists(st.integers(0, 5), max_size=3).map(tuple), min_size=1, max_size=4)


def _devices(k: int) -> tuple[str, ...]:
    return tuple(f"cpu:{i}" for i in range(k))


def _values(k: int, shapes, seed: int, dtype: torch.dtype) -> list[PerReplica]:
    gen = torch.Generator().manual_seed(seed)
    values = []
    for shape in shapes:
        if dtype.is_floating_point:
            components = [torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype) for _ in range(k)]
        else:
            components = [torch.randint(-50, 50, shape, generator=gen, dtype=dtype) for _ in range(k)]
        values.append(PerReplica(components))
    return values


def _oracle(value: PerReplica, op: ReduceOp) -> torch.Tensor:
    total = value.values[0].to(torch.float64)
    for c in value.values[1:]:
        total = total + c.to(torch.float64)
    return total / len(value.values) if op is ReduceOp.MEAN else total


def _check(result, oracle: torch.Tensor, destinations, dtype: torch.dtype, op: ReduceOp) -> None:
    copies = result.values if isinstance(result, Mirrored) else (result,)
    assert len(copies) == len(destinations)
    assert isinstance(result, Mirrored) == (len(destinations) > 1)
    for copy in copies:
        assert copy.shape == oracle.shape
        if dtype.is_floating_point:
            assert copy.dtype == dtype
            tol = 1e-5 if dtype == torch.float32 else 1e-12
            assert torch.allclose(copy.to(torch.float64), oracle, rtol=tol, atol=tol)
        elif op is ReduceOp.SUM:
            assert copy.dtype == dtype and torch.equal(copy.to(torch.float64), oracle)
        else:  # integer MEAN: the true (float) mean, whichever algorithm
            assert copy.is_floating_point() and torch.allclose(copy.to(torch.float64), oracle)
    if len(copies) > 1 and oracle.numel():
        ptrs = {c.data_ptr() for c in copies}
        assert len(ptrs) == len(copies), "each destination gets its own copy"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("k", [2, 3, 8])
@pytest.mark.parametrize("name", list(ALGORITHMS))
@FAST
@given(shapes=shape_lists, seed=st.integers(0, 2**16), op=st.sampled_from([ReduceOp.SUM, ReduceOp.MEAN]),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.int64]), to_one=st.booleans())
def test_batch_reduce_equals_plain_sum(name, k, shapes, seed, op, dtype, to_one):
    ops = ALGORITHMS[name]()
    devices = _devices(k)
    values = _values(k, shapes, seed, dtype)
    snapshot = [[c.clone() for c in v.values] for v in values]
    destinations = ("cpu:0",) if to_one else devices
    results = ops.batch_reduce(op, [(v, destinations) for v in values])
    assert len(results) == len(values)
    for value, result in zip(values, results):
        _check(result, _oracle(value, op), destinations, dtype, op)
    for value, saved in zip(values, snapshot):  # inputs are never modified
        assert all(torch.equal(c, s) for c, s in zip(value.values, saved))


@pytest.mark.parametrize("k", [2, 3, 8])
@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_reduce_with_mixed_destinations(name, k):
    ops = ALGORITHMS[name]()
    devices = _devices(k)
    a, b, c = _values(k, [(3,), (2, 2), ()], seed=k, dtype=torch.float32)
    out = ops.batch_reduce("sum", [(a, devices), (b, "cpu:1"), (c, devices[:2])])
    _check(out[0], _oracle(a, ReduceOp.SUM), devices, torch.float32, ReduceOp.SUM)
    _check(out[1], _oracle(b, ReduceOp.SUM), ("cpu:1",), torch.float32, ReduceOp.SUM)
    _check(out[2], _oracle(c, ReduceOp.SUM), devices[:2], torch.float32, ReduceOp.SUM)


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_reduce_single_value_and_variable_destination(name):
    ops = ALGORITHMS[name]()
    strategy = unison.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        v = unison.Variable([0.0, 0.0])
    value = PerReplica([torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])])
    out = ops.reduce(ReduceOp.MEAN, value, v)
    assert isinstance(out, Mirrored) and [t.tolist() for t in out.values] == [[2.0, 3.0]] * 2
    assert torch.equal(ops.reduce("sum", value, "cpu:0"), torch.tensor([4.0, 6.0]))


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_reduce_of_one_component_copies(name):
    ops = ALGORITHMS[name]()
    x = torch.tensor([1.0, 2.0])
    out = ops.reduce("mean", PerReplica([x]), "cpu:0")
    assert torch.equal(out, x)
    out.add_(1)
    assert x.tolist() == [1.0, 2.0]


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_mismatched_layouts_raise(name):
    ops = ALGORITHMS[name]()
    with pytest.raises(ValueError, match=r"cannot reduce per-replica tensors of different layouts: replica 0 has "
                                         r"shape \(2,\).*replica 1 has shape \(3,\)"):
        ops.reduce("sum", PerReplica([torch.ones(2), torch.ones(3)]), ["cpu:0", "cpu:1"])
    with pytest.raises(TypeError, match=r"cannot reduce replica 1's value of type float"):
        ops.reduce("sum", PerReplica([torch.ones(2), 1.0]), ["cpu:0", "cpu:1"])


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_broadcast_and_gather(name):
    ops = ALGORITHMS[name]()
    x = torch.arange(3.0)
    out = ops.broadcast(x, ["cpu:0", "cpu:1", "cpu:2"])
    assert isinstance(out, Mirrored) and all(torch.equal(t, x) for t in out.values)
    assert len({t.data_ptr() for t in out.values[1:]} | {x.data_ptr()}) == 3
    gathered = ops.gather(PerReplica([torch.zeros(1, 2), torch.ones(2, 2)]), "cpu:0", axis=0)
    assert torch.equal(gathered, torch.tensor([[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]))


def test_reduction_to_one_device_options():
    calls = []

    def accumulate(tensors):
        calls.append(len(tensors))
        return torch.stack(tensors).sum(dim=0)

    ops = ReductionToOneDevice(reduce_to_device="/cpu:1", accumulation_fn=accumulate)
    assert ops.reduce_to_device == "cpu:1"
    value = PerReplica([torch.tensor(1.0), torch.tensor(2.0), torch.tensor(6.0)])
    assert ops.reduce("mean", value, "cpu:0").item() == 3.0
    assert calls == [3]


def test_reduce_op_strings_accepted_by_cross_device_ops():
    value = PerReplica([torch.tensor(1.0), torch.tensor(3.0)])
    for name in ("sum", "SUM", "Sum"):
        assert ReductionToOneDevice().reduce(name, value, "cpu:0").item() == 4.0
    with pytest.raises(ValueError, match=r"reduce_op 'max' is not a ReduceOp"):
        HierarchicalCopyAllReduce().reduce("max", value, "cpu:0")


# --- argument checks ----------------------------------------------------------------------


@pytest.mark.parametrize("num_packs", [-1, -5, 1.5, "2", True, None])
@pytest.mark.parametrize("cls", [NcclAllReduce, HierarchicalCopyAllReduce, AllReduceCrossDeviceOps])
def test_bad_num_packs_raises(cls, num_packs):
    with pytest.raises(ValueError, match=rf"{cls.__name__} requires num_packs >= 0, got num_packs={num_packs!r}"):
        cls(num_packs=num_packs)


def test_unknown_all_reduce_alg_raises():
    with pytest.raises(ValueError, match=r"all_reduce_alg 'ring' is not supported: use one of \('nccl', "
                                         r"'hierarchical_copy'\)"):
        AllReduceCrossDeviceOps("ring")


@pytest.mark.parametrize("devices", [["cpu:0", "cpu:1"], ["cpu:0"], ["cpu:0", "cpu:1", "cpu:2"]])
def test_nccl_on_cpu_devices_raises_at_construction(devices):
    with pytest.raises(ValueError, match=r"NcclAllReduce needs CUDA devices with NCCL, but got \[.*'cpu:0'.*\] "
                                         r"\(not CUDA: .*\); use cross_device_ops=ReductionToOneDevice\(\)"):
        unison.MirroredStrategy(devices, cross_device_ops=NcclAllReduce())


def test_nccl_reduce_on_cpu_raises():
    value = PerReplica([torch.ones(2), torch.ones(2)])
    with pytest.raises(ValueError, match=r"NcclAllReduce needs CUDA devices with NCCL"):
        NcclAllReduce().reduce("sum", value, ["cpu:0", "cpu:1"])


# --- selection --------------------------------------------------------------------------------


@pytest.fixture
def fake_nccl(monkeypatch):
    """Pretends this PyTorch build has NCCL, to check that selection never picks it for CPU."""
    monkeypatch.setattr(torch._C, "_nccl_all_reduce", lambda *a, **k: None, raising=False)
    monkeypatch.setattr(torch.cuda, "nccl", getattr(torch.cuda, "nccl", object()), raising=False)


@pytest.mark.parametrize("devices", [["cpu:0"], ["cpu:0", "cpu:1"], ["cpu:0", "cpu:1", "cpu:2", "cpu:3"],
                                     ["cuda:0", "cpu:0"], ["/device:GPU:0", "/cpu:0"]])
@pytest.mark.parametrize("nccl", [False, True], ids=["no_nccl", "with_nccl"])
def test_select_never_picks_nccl_with_a_cpu_device(devices, nccl, request):
    if nccl:
        request.getfixturevalue("fake_nccl")
    assert type(select_cross_device_ops(devices)) is ReductionToOneDevice


def test_select_picks_nccl_for_several_cuda_devices_with_nccl(fake_nccl):
    ops = select_cross_device_ops(["GPU:0", "GPU:1"])
    assert type(ops) is NcclAllReduce
    assert ops._num_packs == 1


def test_select_one_cuda_device_gives_reduction_to_one_device(fake_nccl):
    assert type(select_cross_device_ops(["cuda:0"])) is ReductionToOneDevice


def test_select_cuda_without_nccl_gives_reduction_to_one_device(monkeypatch):
    monkeypatch.delattr(torch._C, "_nccl_all_reduce", raising=False)
    assert type(select_cross_device_ops(["cuda:0", "cuda:1"])) is ReductionToOneDevice


def test_select_rejects_bad_devices():
    with pytest.raises(ValueError, match=r"device 'tpu:0' is not a device name"):
        select_cross_device_ops(["tpu:0"])
    with pytest.raises(ValueError, match=r"lists device 'cpu:0' twice"):
        select_cross_device_ops(["cpu:0", "cpu:0"])


def test_mirrored_strategy_on_cpu_selects_reduction_to_one_device(fake_nccl):
    strategy = unison.MirroredStrategy(["cpu:0", "cpu:1"])
    assert type(strategy.extended.cross_device_ops) is ReductionToOneDevice


@pytest.mark.parametrize("reduce_op", ["sum", "mean"])
@pytest.mark.parametrize("replicas", [2, 3])
def test_reduction_to_one_device_packs_a_batch_with_the_same_numbers_as_one_value_at_a_time(reduce_op, replicas):
    """A batch is summed as flat buffers per dtype; each value must equal its own reduction bit for bit."""
    devices = [f"cpu:{i}" for i in range(replicas)]
    g = torch.Generator().manual_seed(3)
    values = [
        unison.PerReplica([torch.randn(shape, generator=g, dtype=dtype) for _ in devices])
        for shape, dtype in [((3, 4), torch.float32), ((5,), torch.float64), ((2, 2, 2), torch.float32),
                             ((), torch.float32), ((7,), torch.float64)]
    ]
    ops = unison.ReductionToOneDevice()
    batch = ops.batch_reduce(reduce_op, [(v, devices) for v in values])
    for value, reduced in zip(values, batch):
        alone = ops.reduce(reduce_op, value, devices)
        for got, want in zip(reduced.values, alone.values):
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(got, want)
        assert reduced.values[0].data_ptr() != reduced.values[1].data_ptr()  # every destination has its own copy
    # the float32 values travelled in one buffer (the packed path), not one by one
    assert batch[0].values[0].untyped_storage().data_ptr() == batch[2].values[0].untyped_storage().data_ptr()


def test_reduction_to_one_device_offers_its_in_place_reduction_only_where_it_equals_its_own():
    """The in-place replica reduction is the op's own method: offered for CPU replicas with the
    default sum, never for a sum of the user's, another device, GPUs, or a subclass that
    reduces its own way (whose reduction must run)."""
    from unison._collectives.ops.in_place_reduction import InPlaceReduction
    from unison._collectives.ops.local import ReductionToOneDevice
    from unison._reduce import ReduceOp

    cpus = ["cpu:0", "cpu:1"]  # canonical, as a strategy passes them
    assert isinstance(ReductionToOneDevice().in_place_reduction(ReduceOp.MEAN, cpus), InPlaceReduction)
    assert isinstance(ReductionToOneDevice(reduce_to_device=cpus[1]).in_place_reduction(ReduceOp.SUM, cpus),
                      InPlaceReduction)
    assert ReductionToOneDevice(accumulation_fn=sum).in_place_reduction(ReduceOp.MEAN, cpus) is None
    assert ReductionToOneDevice(reduce_to_device="cpu:7").in_place_reduction(ReduceOp.MEAN, cpus) is None
    assert unison.AllReduceCrossDeviceOps().in_place_reduction(ReduceOp.MEAN, cpus) is None

    calls = []

    class Counting(ReductionToOneDevice):
        def _batch_reduce(self, reduce_op, pairs):
            calls.append(len(pairs))
            return super()._batch_reduce(reduce_op, pairs)

    assert Counting().in_place_reduction(ReduceOp.MEAN, cpus) is None
    strategy = unison.MirroredStrategy(["cpu:0", "cpu:1"], cross_device_ops=Counting())
    with strategy.scope():
        layer = torch.nn.Linear(3, 2)

    def step(x):
        layer(x).sum().backward()

    strategy.run(step, args=(unison.PerReplica([torch.ones(2, 3), 2 * torch.ones(2, 3)]),))
    assert calls, "a subclass's own reduction runs"
    assert torch.allclose(layer.weight.grad, torch.full((2, 3), 3.0))  # mean of 2 and 4 per element
