"""The CUDA paths on one GPU: strategies on ``cuda:0`` train as plain PyTorch does, NCCL
groups of one, gloo groups whose workers share the GPU, compression on CUDA tensors.

Skipped without a CUDA device (CI has none); run where one is lent
(``benchmarks/gpu_check.sh`` runs these and the GPU benchmark together).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import unison
from tests.gpu import _cuda_workers as w
from tests.multi_worker._workers import global_batches, make_mlp, mlp_and_step
from unison._testing import run_workers

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.timeout(180)]

NCCL = pytest.mark.skipif(not torch.distributed.is_nccl_available(), reason="needs NCCL")


def _plain_weights(device: str) -> list[torch.Tensor]:
    """The MLP trained as plain PyTorch on ``device`` over the global batches."""
    model = make_mlp(2, 16).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in global_batches():
        opt.zero_grad()
        nn.functional.cross_entropy(model(x.to(device)), y.to(device)).backward()
        opt.step()
    return [p.detach().cpu() for p in model.parameters()]


def _train_in_process(strategy: unison.Strategy) -> nn.Module:
    """The same training under an in-process ``strategy``: each replica gets its share of
    the batch on its own device."""
    model, step = mlp_and_step(strategy, 2, 16)
    devices = strategy.extended.worker_devices
    for x, y in global_batches():
        if len(devices) == 1:
            strategy.run(step, args=(x.to(devices[0]), y.to(devices[0])))
        else:
            xs, ys = x.chunk(len(devices)), y.chunk(len(devices))
            strategy.run(step, args=(unison.PerReplica([t.to(d) for t, d in zip(xs, devices)]),
                                     unison.PerReplica([t.to(d) for t, d in zip(ys, devices)])))
    return model


def _weights(strategy: unison.Strategy, model: nn.Module) -> list[list[torch.Tensor]]:
    """Every replica's copy of every parameter, on the CPU."""
    out = []
    for p in model.parameters():
        parts = strategy.experimental_local_results(p) if isinstance(p, unison.DistributedValues) else (p,)
        out.append([c.detach().cpu() for c in parts])
    return out


def _assert_close_all(got: list[torch.Tensor], want: list[torch.Tensor], atol: float = 1e-5) -> None:
    for g, e in zip(got, want, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=atol)


@pytest.fixture(scope="module")
def plain_cuda() -> list[torch.Tensor]:
    return _plain_weights("cuda:0")


@pytest.fixture(scope="module")
def plain_cpu() -> list[torch.Tensor]:
    return _plain_weights("cpu")


@pytest.mark.parametrize("make", [lambda: unison.OneDeviceStrategy("cuda:0"),
                                  lambda: unison.MirroredStrategy(["cuda:0"]),
                                  lambda: unison.MirroredStrategy(),  # this machine's GPUs
                                  lambda: unison.CentralStorageStrategy(compute_devices=["cuda:0"],
                                                                        parameter_device="cuda:0")],
                         ids=["one_device", "mirrored_cuda0", "mirrored_default", "central_storage"])
def test_one_gpu_strategies_train_as_plain_pytorch_on_the_gpu(make, plain_cuda):
    strategy = make()
    model = _train_in_process(strategy)
    for p in model.parameters():
        assert all(c.is_cuda for c in (strategy.experimental_local_results(p)
                                       if isinstance(p, unison.DistributedValues) else (p,)))
    weights = _weights(strategy, model)
    _assert_close_all([copies[0] for copies in weights], plain_cuda)


def test_mirrored_over_the_gpu_and_the_cpu_trains_as_one_device(plain_cpu):
    """Replicas on two kinds of device: the reduction crosses them, and both copies stay equal."""
    strategy = unison.MirroredStrategy(["cuda:0", "cpu:0"])
    model = _train_in_process(strategy)
    weights = _weights(strategy, model)
    assert [str(c.device) for c in strategy.experimental_local_results(next(model.parameters()))] == \
        ["cuda:0", "cpu"]
    _assert_close_all([copies[0] for copies in weights], plain_cpu)
    for gpu_copy, cpu_copy in weights:
        torch.testing.assert_close(gpu_copy, cpu_copy, rtol=0, atol=1e-6)


def test_central_storage_across_the_gpu_and_the_cpu_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"compute_devices \['cuda:0'\] are on another physical device than "
                                         r"parameter_device 'cpu:0'.*use MirroredStrategy"):
        unison.CentralStorageStrategy(compute_devices=["cuda:0"], parameter_device="cpu:0")


def test_distributed_dataset_puts_each_replicas_batch_on_its_gpu():
    strategy = unison.MirroredStrategy(["cuda:0"])
    data = torch.utils.data.TensorDataset(torch.randn(16, 3), torch.arange(16))
    batches = list(strategy.experimental_distribute_dataset(data, global_batch_size=8))
    assert len(batches) == 2
    x, y = batches[0]
    assert x.device == torch.device("cuda", 0) and y.device == torch.device("cuda", 0)
    assert x.shape == (8, 3)


def test_a_model_built_in_a_gpu_scope_starts_from_plain_pytorchs_weights():
    """Initial values are drawn on the CPU, as for a model built there and moved: the same
    seed gives the same weights with or without a strategy, on the CPU or the GPU."""
    plain = make_mlp(2, 16)
    for strategy in (unison.OneDeviceStrategy("cuda:0"), unison.MirroredStrategy(["cuda:0", "cpu:0"]),
                     unison.OneDeviceStrategy("cpu:0")):
        with strategy.scope():
            model = make_mlp(2, 16)
            extra = torch.nn.Linear(3, 3)  # a fill after the seeded model: the generator advanced as plain's
        for copies, want in zip(_weights(strategy, model), plain.parameters()):
            for copy in copies:
                assert torch.equal(copy, want.detach())
        torch.manual_seed(0)
        make_mlp(2, 16)
        assert torch.equal(extra.weight.detach().cpu() if not isinstance(extra.weight, unison.DistributedValues)
                           else strategy.experimental_local_results(extra.weight)[0].cpu(),
                           torch.nn.Linear(3, 3).weight.detach())


@NCCL
@pytest.mark.timeout(150)
def test_an_nccl_group_of_one_trains_as_plain_pytorch(plain_cuda):
    (result,) = run_workers(w.train_on_cuda, 1, args=("NCCL",), timeout=120)
    assert result["backend"] == "nccl" and result["devices"] == ["cuda:0"]
    _assert_close_all(result["weights"], plain_cuda)


@NCCL
@pytest.mark.timeout(150)
def test_nccl_reduces_cuda_tensors_on_the_gpu():
    (result,) = run_workers(w.reduce_on_cuda, 1, args=("NCCL",), timeout=120)
    for got, sent in zip(result["means"], result["inputs"]):
        torch.testing.assert_close(got, sent)
    assert set(result["mean_devices"]) == {"cuda:0"}
    torch.testing.assert_close(result["sum"], torch.ones(3))


@pytest.mark.timeout(150)
@pytest.mark.parametrize("implementation", ["AUTO", "RING"])
def test_two_workers_sharing_one_gpu_train_as_one_device(implementation, plain_cuda):
    """Two processes on one GPU cannot form an NCCL group (NCCL takes one rank per GPU):
    AUTO chooses gloo, which reduces the CUDA gradients; training equals one device's."""
    results = run_workers(w.train_on_cuda, 2, args=(implementation,), timeout=120)
    for result in results:
        assert result["backend"] == "gloo" and result["devices"] == ["cuda:0"]
        _assert_close_all(result["weights"], plain_cuda)
    assert all(torch.equal(a, b) for a, b in zip(results[0]["weights"], results[1]["weights"]))


@pytest.mark.timeout(150)
def test_gloo_reduces_cuda_tensors_of_two_workers():
    results = run_workers(w.reduce_on_cuda, 2, timeout=120)
    for result in results:
        for i, got in enumerate(result["means"]):
            want = (results[0]["inputs"][i] + results[1]["inputs"][i]) / 2
            if want.is_floating_point():
                torch.testing.assert_close(got, want)
            else:
                assert torch.equal(got, want)
        assert set(result["mean_devices"]) == {"cuda:0"}
        torch.testing.assert_close(result["sum"], torch.full((3,), 3.0))


@pytest.mark.timeout(150)
@pytest.mark.parametrize("compression", ["bf16", "fp16", "powersgd"])
def test_compression_on_cuda_gradients_of_two_workers_stays_close(compression, plain_cuda):
    results = run_workers(w.train_on_cuda, 2, args=("AUTO", compression), timeout=120)
    for result in results:
        assert result["transport"] in ("CompressedTransport", "PowerSGDTransport")
        _assert_close_all(result["weights"], plain_cuda, atol=5e-2)
    assert all(torch.equal(a, b) for a, b in zip(results[0]["weights"], results[1]["weights"]))


def test_nccl_with_two_workers_on_one_gpu_is_refused_with_the_fix():
    if torch.cuda.device_count() > 1:
        pytest.skip("this machine has a GPU for each worker")
    resolver = unison.SimpleClusterResolver(unison.ClusterSpec({"worker": ["127.0.0.1:1", "127.0.0.1:2"]}),
                                            task_type="worker", task_id=0)
    with pytest.raises(ValueError, match=r"NCCL.*one GPU per worker.*RING"):
        unison.MultiWorkerMirroredStrategy(resolver, unison.CommunicationOptions(implementation="nccl"),
                                           devices=["cuda:0"])


def test_a_checkpoint_saved_from_the_gpu_loads_on_the_cpu(tmp_path):
    strategy = unison.OneDeviceStrategy("cuda:0")
    model = _train_in_process(strategy)
    path = tmp_path / "model.pt"
    assert unison.save_checkpoint({"model": model.state_dict()}, path, strategy)
    state = unison.load_checkpoint(path)
    assert all(t.device.type == "cpu" for t in state["model"].values())
    cpu_model = make_mlp(2, 16)
    cpu_model.load_state_dict(state["model"])
    _assert_close_all([p.detach() for p in cpu_model.parameters()], [p.detach().cpu() for p in model.parameters()],
                      atol=0)
