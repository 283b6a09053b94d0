"""Correct = equal to single-device: N replicas on global batch B train like one device on B."""

from __future__ import annotations

import pytest
import torch

import unison
from tests.strategies._training import (
    GLOBAL_BATCH,
    STEPS,
    batches,
    max_abs_diff,
    replicas_identical,
    train_plain,
    train_strategy,
)

pytestmark = pytest.mark.timeout(60)

TOL = 1e-5
STRATEGIES = {
    "mirrored_2": lambda: unison.MirroredStrategy(["cpu:0", "cpu:1"]),
    "central_storage_2": lambda: unison.CentralStorageStrategy(compute_devices=["cpu:0", "cpu:1"],
                                                                 parameter_device="cpu:0"),
    "one_device": lambda: unison.OneDeviceStrategy("cpu:0"),
    "mirrored_1": lambda: unison.MirroredStrategy(["cpu:0"]),
    "mirrored_4": lambda: unison.MirroredStrategy([f"cpu:{i}" for i in range(4)]),
    "mirrored_2_hierarchical": lambda: unison.MirroredStrategy(
        ["cpu:0", "cpu:1"], cross_device_ops=unison.HierarchicalCopyAllReduce()),
    "mirrored_2_all_reduce_3_packs": lambda: unison.MirroredStrategy(
        ["cpu:0", "cpu:1"], cross_device_ops=unison.AllReduceCrossDeviceOps("hierarchical_copy", num_packs=3)),
}


def sgd_momentum(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


@pytest.fixture(scope="module")
def plain_sgd_momentum():
    threads = torch.get_num_threads()  # module scope: set up before conftest's one-thread fixture
    torch.set_num_threads(1)
    try:
        return train_plain(sgd_momentum)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_mlp_sgd_momentum_matches_single_device(name, plain_sgd_momentum):
    assert GLOBAL_BATCH == 64 and STEPS == 20
    strategy = STRATEGIES[name]()
    model, _ = train_strategy(strategy, sgd_momentum)
    assert max_abs_diff(strategy, model, plain_sgd_momentum) <= TOL
    assert replicas_identical(strategy, model)
    # it did train: the weights moved away from their initial values
    assert max_abs_diff(strategy, model, train_plain(sgd_momentum, data=[])) > 1e-2


def test_mirrored_parameters_stay_mirrored_variables():
    strategy = STRATEGIES["mirrored_2"]()
    model, _ = train_strategy(strategy, sgd_momentum, data=batches(steps=2))
    assert all(isinstance(p, unison.MirroredVariable) for p in model.parameters())


@pytest.mark.parametrize("name", ["mirrored_2", "central_storage_2", "one_device"])
def test_adam_matches_single_device(name):
    def adam(params):
        return torch.optim.Adam(params, lr=0.01)

    strategy = STRATEGIES[name]()
    model, _ = train_strategy(strategy, adam)
    assert max_abs_diff(strategy, model, train_plain(adam)) <= TOL
    assert replicas_identical(strategy, model)


@pytest.mark.parametrize("name", ["mirrored_2", "central_storage_2", "one_device"])
def test_step_lr_scheduler_keeps_working(name):
    def sched(opt):
        return torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.3)

    strategy = STRATEGIES[name]()
    model, opt = train_strategy(strategy, sgd_momentum, sched)
    reference = train_plain(sgd_momentum, sched)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05 * 0.3 ** (STEPS // 5))
    assert max_abs_diff(strategy, model, reference) <= TOL
    # the schedule changed the result: without it the weights differ
    assert max_abs_diff(strategy, model, train_plain(sgd_momentum)) > 1e-3


def test_sum_gradient_reduction_with_global_batch_scaled_loss():
    # TF-style: each replica's loss is its examples' summed loss / the global batch size,
    # and gradients are summed over replicas.
    strategy = unison.MirroredStrategy(["cpu:0", "cpu:1"])
    strategy.extended.gradient_reduce_op = unison.ReduceOp.SUM
    from tests.strategies._training import make_mlp, split

    with strategy.scope():
        model = make_mlp()
        opt = sgd_momentum(model.parameters())

    def step(x, y):
        opt.zero_grad()
        per_example = torch.nn.functional.mse_loss(model(x), y, reduction="none").mean(dim=1)
        (per_example.sum() / GLOBAL_BATCH).backward()
        opt.step()

    for x, y in batches():
        strategy.run(step, args=(split(strategy, x), split(strategy, y)))
    assert max_abs_diff(strategy, model, train_plain(sgd_momentum)) <= TOL
