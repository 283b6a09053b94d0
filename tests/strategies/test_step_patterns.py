"""Steps that change the model or the optimizer mid-step train as on one device under several replicas.

Each of these broke under Mirrored or CentralStorage with two CPU replicas:

- ``torch.func.functional_call`` inside a replica left one replica's plain tensor in the
  module in place of the variable (the module's parameters swap back what a lookup
  returned, the replica's component), and every later step trained wrongly;
- ``p.requires_grad_(b)`` inside a replica (freezing a layer, a GAN toggling its
  discriminator) was refused as an unaggregated write;
- ``opt.add_param_group(...)`` inside a replica added the group once per replica;
- under CentralStorage a replica read the variables right after ``opt.step()`` while
  replica 0 was still writing them (a GAN's discriminator step saw the generator before
  its update).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import unison
from tests.strategies._training import components
from unison.errors import UsageError

pytestmark = pytest.mark.timeout(60)

SEVERAL_REPLICAS = {
    "mirrored": lambda: unison.MirroredStrategy(["cpu:0", "cpu:1"]),
    "central_storage": lambda: unison.CentralStorageStrategy(["cpu:0", "cpu:1"]),
}
Build = Callable[[], dict[str, Any]]
Body = Callable[[dict[str, Any], torch.Tensor, torch.Tensor, int], None]


def _data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)) for _ in range(steps)]


def _train(strategy: unison.Strategy | None, build: Build, body: Body, steps: int = 6,
           between: Callable[[dict[str, Any], int], None] | None = None) -> dict[str, Any]:
    """``body(state, x, y, step)`` on one device (whole batches) or in every replica (halves);
    ``between(state, step)`` before each step, outside ``strategy.run``."""
    torch.manual_seed(0)
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        state = build()
    for i, (x, y) in enumerate(_data(steps)):
        if between is not None:
            between(state, i)
        if strategy is None:
            body(state, x, y, i)
        else:
            strategy.run(lambda x, y, i=i: body(state, x, y, i),
                         args=(unison.PerReplica(list(x.chunk(2))), unison.PerReplica(list(y.chunk(2)))))
    return state


def _assert_same_training(strategy_factory: Callable[[], unison.Strategy], build: Build, body: Body,
                          between: Callable[[dict[str, Any], int], None] | None = None) -> dict[str, Any]:
    expected = _train(None, build, body, between=between)["model"]
    strategy = strategy_factory()
    state = _train(strategy, build, body, between=between)
    for got, want in zip(state["model"].parameters(), expected.parameters()):
        assert isinstance(got, unison.MirroredVariable)  # still the variable, not a replica's tensor
        for component in components(strategy, got):
            torch.testing.assert_close(component, want.detach(), rtol=0, atol=1e-6)
    return state


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _plain_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _gan(optimizer: type[torch.optim.Optimizer], toggle: bool) -> tuple[Build, Body]:
    def build() -> dict[str, Any]:
        generator, critic = _mlp(), nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        return {"model": nn.ModuleDict({"G": generator, "D": critic}),
                "opt_g": optimizer(generator.parameters(), lr=0.01), "opt_d": optimizer(critic.parameters(), lr=0.01)}

    def body(s: dict[str, Any], x: torch.Tensor, y: torch.Tensor, i: int) -> None:
        generator, critic = s["model"]["G"], s["model"]["D"]
        if toggle:
            critic.requires_grad_(False)
        s["opt_g"].zero_grad()
        (-critic(generator(x)).mean()).backward()
        s["opt_g"].step()
        if toggle:
            critic.requires_grad_(True)
        s["opt_d"].zero_grad()
        (critic(generator(x).detach()).mean() - critic(y).mean()).backward()  # the generator after its step
        s["opt_d"].step()

    return build, body


@pytest.mark.parametrize("strategy_factory", list(SEVERAL_REPLICAS.values()), ids=list(SEVERAL_REPLICAS))
@pytest.mark.parametrize("toggle", [False, True], ids=["both_trained", "critic_toggled"])
def test_a_gan_step_trains_as_on_one_device(strategy_factory, toggle):
    _assert_same_training(strategy_factory, *_gan(torch.optim.Adam, toggle))


@pytest.mark.parametrize("strategy_factory", list(SEVERAL_REPLICAS.values()), ids=list(SEVERAL_REPLICAS))
def test_a_layer_frozen_in_the_step_stops_training(strategy_factory):
    def build() -> dict[str, Any]:
        model = _mlp()
        return {"model": model, "opt": torch.optim.AdamW(model.parameters(), lr=0.01)}

    def body(s: dict[str, Any], x: torch.Tensor, y: torch.Tensor, i: int) -> None:
        if i == 3:  # through the variables (parameters()): the attribute and the method
            weight, bias = s["model"][0].parameters()
            weight.requires_grad = False
            bias.requires_grad_(False)
        _plain_step(s["model"], s["opt"], x, y)

    state = _assert_same_training(strategy_factory, build, body)
    assert not state["model"][0].weight.requires_grad and state["model"][2].weight.requires_grad


@pytest.mark.parametrize("strategy_factory", list(SEVERAL_REPLICAS.values()), ids=list(SEVERAL_REPLICAS))
def test_a_param_group_added_in_the_step_is_added_once(strategy_factory):
    def build() -> dict[str, Any]:
        model = _mlp()
        model[2].requires_grad_(False)
        return {"model": model, "opt": torch.optim.SGD(model[0].parameters(), lr=0.1, momentum=0.9)}

    def body(s: dict[str, Any], x: torch.Tensor, y: torch.Tensor, i: int) -> None:
        if i == 2:  # unfreeze the head
            s["model"][2].requires_grad_(True)
            s["opt"].add_param_group({"params": list(s["model"][2].parameters()), "lr": 0.05})
        _plain_step(s["model"], s["opt"], x, y)

    state = _assert_same_training(strategy_factory, build, body)
    assert len(state["opt"].param_groups) == 2


@pytest.mark.parametrize("strategy_factory", list(SEVERAL_REPLICAS.values()), ids=list(SEVERAL_REPLICAS))
def test_functional_call_with_the_modules_parameters_trains_as_on_one_device(strategy_factory):
    def build() -> dict[str, Any]:
        model = _mlp()
        return {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1)}

    def body(s: dict[str, Any], x: torch.Tensor, y: torch.Tensor, i: int) -> None:
        model = s["model"]
        out = torch.func.functional_call(model, dict(model.named_parameters()), (x,))
        s["opt"].zero_grad()
        nn.functional.mse_loss(out, y).backward()
        s["opt"].step()

    _assert_same_training(strategy_factory, build, body)


@pytest.mark.parametrize("strategy_factory", list(SEVERAL_REPLICAS.values()), ids=list(SEVERAL_REPLICAS))
def test_functional_call_with_other_tensors_is_per_replica(strategy_factory):
    """A MAML-style inner step: each replica runs the module on its own adapted weights."""
    strategy = strategy_factory()
    torch.manual_seed(0)
    with strategy.scope():
        model = _mlp()
    reference = _mlp()
    reference.load_state_dict({k: v.detach().clone() for k, v in model.state_dict().items()})
    x, y = _data(1)[0]

    def outer_loss(net: nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        params = dict(net.named_parameters())
        (x_support, x_query), (y_support, y_query) = xb.chunk(2), yb.chunk(2)
        inner = nn.functional.mse_loss(torch.func.functional_call(net, params, (x_support,)), y_support)
        grads = torch.autograd.grad(inner, list(params.values()), create_graph=True)
        adapted = {name: p - 0.1 * g for (name, p), g in zip(params.items(), grads)}
        return nn.functional.mse_loss(torch.func.functional_call(net, adapted, (x_query,)), y_query)

    expected = []
    for xb, yb in zip(x.chunk(2), y.chunk(2)):  # each replica's half, on one device
        reference.zero_grad()
        outer_loss(reference, xb, yb).backward()
        expected.append([p.grad.clone() for p in reference.parameters()])
    mean = [(a + b) / 2 for a, b in zip(*expected)]

    def step(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        outer_loss(model, xb, yb).backward()
        return model[0].weight.detach().clone()

    seen = strategy.run(step, args=(unison.PerReplica(list(x.chunk(2))), unison.PerReplica(list(y.chunk(2)))))
    for value in seen.values:  # each replica ran on the module's weights, not a peer's adapted ones
        torch.testing.assert_close(value, reference[0].weight.detach())
    for param, want in zip(model.parameters(), mean):
        assert isinstance(param, unison.MirroredVariable)
        for i in range(2):
            torch.testing.assert_close(param.component(i).grad, want, rtol=0, atol=1e-6)


def test_a_parameter_deleted_inside_a_replica_is_refused_with_the_fix():
    strategy = unison.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = nn.Linear(3, 2)

    def step() -> None:
        del model.weight

    with pytest.raises(UsageError, match=r"del module._parameters\['weight'\].*functional_call"):
        strategy.run(step)
    assert isinstance(model.weight, unison.MirroredVariable)  # nothing was removed
    del model.bias  # outside run: as in PyTorch
    assert "bias" not in dict(model.named_parameters())


class _WithFrozenScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(8, 4)
        self.scale = nn.Parameter(torch.full((4,), 0.5), requires_grad=False)  # made frozen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x) * self.scale


@pytest.mark.parametrize("strategy_factory", list(SEVERAL_REPLICAS.values()), ids=list(SEVERAL_REPLICAS))
@pytest.mark.parametrize("where", ["in_step", "between_steps"])
def test_a_parameter_made_frozen_and_unfrozen_later_is_reduced(strategy_factory, where):
    """It was never registered for reduction: once unfrozen, each replica stepped it with its own gradient."""
    unfreeze_at = 2

    def build() -> dict[str, Any]:
        model = _WithFrozenScale()
        return {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1)}

    def body(s: dict[str, Any], x: torch.Tensor, y: torch.Tensor, i: int) -> None:
        if where == "in_step" and i == unfreeze_at:
            s["model"].scale.requires_grad_(True)
        _plain_step(s["model"], s["opt"], x, y)

    def between(s: dict[str, Any], i: int) -> None:  # cross-replica context
        if where == "between_steps" and i == unfreeze_at:
            s["model"].scale.requires_grad_(True)

    state = _assert_same_training(strategy_factory, build, body, between=between)
    assert not torch.equal(state["model"].scale.detach(), torch.full((4,), 0.5))
