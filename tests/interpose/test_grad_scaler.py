"""A mixed-precision step with ``torch.amp.GradScaler`` works unchanged under several replicas.

The replica threads share the step's one scaler: its per-optimizer state used to
collide between them (``No inf checks were recorded prior to update``), and each
replica's ``update()`` moved the scale again. Now the step trains as on one device:
same weights, same scale after every step, an overflow in one replica's half of the
batch skips the step on every replica.
"""

from __future__ import annotations

import contextlib
import pickle

import pytest
import torch
from torch import nn

import unison
from unison.errors import MergeCallError

pytestmark = pytest.mark.timeout(60)

OVERFLOW_STEP = 7


def _data(steps: int = 14):
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)) for _ in range(steps)]
    data[OVERFLOW_STEP][0][-1, 0] = float("inf")  # in the last replica's half of the batch
    return data


def _train(strategy, make_optimizer, replicas: int = 1, unscale_and_clip: bool = True):
    """Trains an MLP with a GradScaler; returns its weights, the scale after each step and the scaler."""
    torch.manual_seed(0)
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        opt = make_optimizer(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=3)

    def step(x, y):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        if unscale_and_clip:
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()

    scales = []
    for x, y in _data():
        if strategy is None:
            step(x, y)
        else:
            strategy.run(step, args=(unison.PerReplica(list(x.chunk(replicas))),
                                     unison.PerReplica(list(y.chunk(replicas)))))
        scales.append(scaler.get_scale())
    return model, scales, scaler


STRATEGIES = {
    "mirrored": lambda: unison.MirroredStrategy(["cpu:0", "cpu:1"]),
    "central_storage": lambda: unison.CentralStorageStrategy(["cpu:0", "cpu:1"]),
}
OPTIMIZERS = {
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adam_fused": lambda params: torch.optim.Adam(params, lr=1e-2, fused=True),  # can unscale itself
}


def _weights(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("unscale_and_clip", [True, False], ids=["unscale_clip_step", "step"])
def test_grad_scaler_trains_as_on_one_device(strategy, optimizer, unscale_and_clip):
    reference, expected_scales, reference_scaler = _train(None, OPTIMIZERS[optimizer],
                                                          unscale_and_clip=unscale_and_clip)
    assert expected_scales[OVERFLOW_STEP] == expected_scales[OVERFLOW_STEP - 1] / 2  # the overflow backed off
    model, scales, scaler = _train(STRATEGIES[strategy](), OPTIMIZERS[optimizer], 2, unscale_and_clip)
    assert scales == expected_scales
    for got, want in zip(_weights(model), _weights(reference)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for param in model.parameters():
        components = param.values
        assert all(torch.equal(c, components[0]) for c in components)  # both skipped the overflow step
    assert scaler.state_dict() == reference_scaler.state_dict()
    assert pickle.loads(pickle.dumps(scaler)).get_scale() == scaler.get_scale()  # between steps, as on one device


def test_every_replica_skips_when_one_replica_finds_an_inf():
    # On CPU replicas the gradients are reduced before unscale_, so an inf reaches every
    # replica anyway; here one replica's gradient turns inf after the reduction (as an
    # unreduced gradient on a GPU replica can): without agreement, replica 0 would step
    # and replica 1 skip, and the replicas would part.
    strategy = unison.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    before = _weights(model)

    def step(x):
        opt.zero_grad()
        scaler.scale(model(x).sum()).backward()
        if unison.get_replica_context().local_replica_id == 1:
            model.weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()

    strategy.run(step, args=(unison.PerReplica([torch.ones(2, 4), torch.ones(2, 4)]),))
    assert scaler.get_scale() == 2.0  # backed off once, not once per replica
    for param, want in zip(model.parameters(), before):
        assert all(torch.equal(c, want) for c in param.values)  # no replica stepped


def test_a_replica_that_skips_update_is_named():
    strategy = unison.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")

    def step(x):
        opt.zero_grad()
        scaler.scale(model(x).sum()).backward()
        scaler.step(opt)
        if unison.get_replica_context().local_replica_id == 0:
            scaler.update()

    with pytest.raises(MergeCallError, match="returned without calling it"):
        strategy.run(step, args=(unison.PerReplica([torch.ones(2, 4), torch.ones(2, 4)]),))


def test_a_disabled_scaler_is_a_plain_step_in_replicas():
    strategy = unison.MirroredStrategy(["cpu:0", "cpu:1"])
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        opt = OPTIMIZERS["sgd_momentum"](model.parameters())
    scaler = torch.amp.GradScaler("cpu", enabled=False)

    def step(x, y):
        opt.zero_grad()
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        scaler.step(opt)
        scaler.update()

    for x, y in _data()[:OVERFLOW_STEP]:  # a disabled scaler does not skip overflows
        strategy.run(step, args=(unison.PerReplica(list(x.chunk(2))), unison.PerReplica(list(y.chunk(2)))))
    torch.manual_seed(0)
    reference_model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    reference_opt = OPTIMIZERS["sgd_momentum"](reference_model.parameters())
    for x, y in _data()[:OVERFLOW_STEP]:
        reference_opt.zero_grad()
        nn.functional.mse_loss(reference_model(x), y).backward()
        reference_opt.step()
    for got, want in zip(_weights(model), _weights(reference_model)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_update_after_run_reads_every_replicas_checks():
    # The replicas step inside run; the caller updates once per iteration, outside it.
    reference, expected_scales, _ = _train(None, OPTIMIZERS["sgd_momentum"], unscale_and_clip=False)
    strategy = unison.MirroredStrategy(["cpu:0", "cpu:1"])
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        opt = OPTIMIZERS["sgd_momentum"](model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=3)

    def step(x, y):
        opt.zero_grad()
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        scaler.step(opt)

    scales = []
    for x, y in _data():
        strategy.run(step, args=(unison.PerReplica(list(x.chunk(2))), unison.PerReplica(list(y.chunk(2)))))
        scaler.update()
        scales.append(scaler.get_scale())
    assert scales == expected_scales
    for got, want in zip(_weights(model), _weights(reference)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
