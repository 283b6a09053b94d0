"""``scheduler.step()`` and ``ema.update_parameters()`` inside ``strategy.run`` run once per step, as on one device.

Every replica thread used to make the call: the schedule ran once per replica (2x fast
on two replicas, a 0.03 weight difference after 8 steps of StepLR), and the average of an
``AveragedModel`` took each step twice (n_averaged 15 after 8 steps, 0.01 off).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import unison
from unison.errors import MergeCallError

pytestmark = pytest.mark.timeout(60)

SEVERAL_REPLICAS = {
    "mirrored": lambda: unison.MirroredStrategy(["cpu:0", "cpu:1"]),
    "central_storage": lambda: unison.CentralStorageStrategy(["cpu:0", "cpu:1"]),
}
SCHEDULERS = {
    "step": lambda opt: lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
    "one_cycle": lambda opt: lr_scheduler.OneCycleLR(opt, max_lr=0.2, total_steps=10),
    "warmup_then_cosine": lambda opt: lr_scheduler.SequentialLR(
        opt, [lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=3),
              lr_scheduler.CosineAnnealingLR(opt, T_max=7)],
        milestones=[3]),
    "chained": lambda opt: lr_scheduler.ChainedScheduler(
        [lr_scheduler.ConstantLR(opt, factor=0.5, total_iters=4), lr_scheduler.ExponentialLR(opt, gamma=0.9)]),
    "warm_restarts": lambda opt: lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=3),
    "plateau": lambda opt: lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0, threshold=0.5),
}


def _data(steps: int = 10):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)) for _ in range(steps)]


def _train(strategy, scheduler: str, replicas: int = 2):
    """Weights and the learning rate after each step; the scheduler steps inside the step."""
    torch.manual_seed(0)
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        sched = SCHEDULERS[scheduler](opt)

    def step(x, y):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        sched.step(loss.detach()) if scheduler == "plateau" else sched.step()

    lrs = []
    for x, y in _data():
        if strategy is None:
            step(x, y)
        else:
            strategy.run(step, args=(unison.PerReplica(list(x.chunk(replicas))),
                                     unison.PerReplica(list(y.chunk(replicas)))))
        lrs.append(opt.param_groups[0]["lr"])
    return [p.detach().clone() for p in model.parameters()], lrs


@pytest.mark.parametrize("scheduler", list(SCHEDULERS))
@pytest.mark.parametrize("strategy_factory", list(SEVERAL_REPLICAS.values()), ids=list(SEVERAL_REPLICAS))
def test_a_scheduler_stepped_in_the_step_follows_one_devices_schedule(scheduler, strategy_factory):
    expected_weights, expected_lrs = _train(None, scheduler)
    assert len(set(expected_lrs)) > 2  # the schedule moves
    weights, lrs = _train(strategy_factory(), scheduler)
    assert lrs == pytest.approx(expected_lrs, rel=1e-12)
    for got, want in zip(weights, expected_weights):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _mirrored_step_lr(step_scheduler_in_replica) -> tuple:
    """A Mirrored linear model whose step steps a StepLR in the replicas ``step_scheduler_in_replica(id)`` names."""
    strategy = unison.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    def step(x):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        if step_scheduler_in_replica(unison.get_replica_context().local_replica_id):
            sched.step()

    def run():
        strategy.run(step, args=(unison.PerReplica([torch.ones(2, 4), torch.ones(2, 4)]),))

    return run, opt, sched


def test_a_scheduler_stepped_after_run_is_untouched():
    run, opt, sched = _mirrored_step_lr(lambda replica: False)
    for _ in range(3):
        run()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 / 8)


def test_a_replica_that_skips_the_scheduler_is_named():
    run, _, _ = _mirrored_step_lr(lambda replica: replica == 0)
    with pytest.raises(MergeCallError, match="returned without calling it"):
        run()


AVERAGES = {
    "ema": lambda model: AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9)),
    "swa": lambda model: AveragedModel(model),
    "ema_with_buffers": lambda model: AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True),
}


def _train_with_average(strategy, average: str, replicas: int = 2):
    torch.manual_seed(0)
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        averaged = AVERAGES[average](model)

    def step(x, y):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        averaged.update_parameters(model)

    for x, y in _data(8):
        if strategy is None:
            step(x, y)
        else:
            strategy.run(step, args=(unison.PerReplica(list(x.chunk(replicas))),
                                     unison.PerReplica(list(y.chunk(replicas)))))
    return [p.detach().clone() for p in averaged.module.parameters()], int(averaged.n_averaged)


@pytest.mark.parametrize("average", list(AVERAGES))
@pytest.mark.parametrize("strategy_factory", list(SEVERAL_REPLICAS.values()), ids=list(SEVERAL_REPLICAS))
def test_an_average_updated_in_the_step_takes_each_step_once(average, strategy_factory):
    expected, expected_count = _train_with_average(None, average)
    got, count = _train_with_average(strategy_factory(), average)
    assert count == expected_count == 8
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_scheduler_class_defined_after_the_strategy_is_wrapped_too():
    strategy = unison.MirroredStrategy(["cpu:0", "cpu:1"])  # wraps the classes that exist now

    class CountingSteps(lr_scheduler.LRScheduler):
        def step(self, epoch=None):  # a step of its own, not calling LRScheduler's
            self.calls = getattr(self, "calls", 0) + 1
            self._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    with strategy.scope():
        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = CountingSteps(opt)

    def step(x):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        sched.step()

    for _ in range(3):
        strategy.run(step, args=(unison.PerReplica([torch.ones(2, 4), torch.ones(2, 4)]),))
    assert sched.calls == 1 + 3  # LRScheduler.__init__'s, then once per step, not once per replica
