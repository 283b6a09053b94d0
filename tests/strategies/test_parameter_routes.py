"""A parameter made by any route joins the strategy, under several in-process replicas.

Routes other than building a module in ``scope()``: deep copies (``nn.TransformerEncoder``
clones its layer with ``copy.deepcopy``; EMA and teacher copies), ``load_state_dict(...,
assign=True)``, ``to_empty()``, ``torch.nn.utils.parametrize`` and ``register_parameter``
after construction. Each trains like one device, or is refused at its first step. Before
``_strategies/joining.py``, a module deep-copied in scope held plain parameters that both
replica threads trained at once (wrong values, or ``free(): corrupted unsorted chunks``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

import unison
from unison.errors import UsageError

pytestmark = pytest.mark.timeout(60)

STRATEGIES = {
    "mirrored": lambda: unison.MirroredStrategy(["cpu:0", "cpu:1"]),
    "central_storage": lambda: unison.CentralStorageStrategy(["cpu:0", "cpu:1"]),
}
VOCAB, WIDTH = 40, 16


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _mlp_data(steps: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)) for _ in range(steps)]


def _mlp_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)


def _language_model() -> nn.Module:
    """A 2-layer TransformerEncoder LM: its layers are deep copies of one layer."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(WIDTH, 2, 32, dropout=0.0, batch_first=True)
    return nn.ModuleDict({"embed": nn.Embedding(VOCAB, WIDTH),
                          "encoder": nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
                          "head": nn.Linear(WIDTH, VOCAB)})


def _lm_data(steps: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, VOCAB, (8, 7), generator=g) for _ in range(steps)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model["head"](model["encoder"](model["embed"](x)))
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def _train(model: nn.Module, loss: Callable, data: list, strategy: unison.Strategy | None = None) -> nn.Module:
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        value = loss(model, x, y)
        value.backward()
        opt.step()
        return value

    for x, y in data:
        if strategy is None:
            step(x, y)
        else:
            halves = [unison.PerReplica(list(t.chunk(2))) for t in (x, y)]
            strategy.run(step, args=tuple(halves))
    return model


def _assert_equal_params(got: nn.Module, want: nn.Module) -> None:
    pairs = list(zip(got.parameters(), want.parameters(), strict=True))
    for mine, theirs in pairs:
        assert isinstance(mine, unison.MirroredVariable), type(mine)
        for component in mine.values:  # every replica's copy, not only the first
            torch.testing.assert_close(component, theirs.detach(), atol=1e-5, rtol=0)


@pytest.fixture(params=sorted(STRATEGIES))
def strategy(request: Any) -> unison.Strategy:
    return STRATEGIES[request.param]()


def test_transformer_encoder_cloned_in_scope_trains_as_on_one_device(strategy):
    want = _train(_language_model(), _lm_loss, _lm_data())
    with strategy.scope():
        model = _language_model()
    assert all(isinstance(p, unison.MirroredVariable) for p in model.parameters())
    _assert_equal_params(_train(model, _lm_loss, _lm_data(), strategy), want)


def test_a_copy_taken_outside_the_scope_trains_as_on_one_device(strategy):
    with strategy.scope():
        original = _mlp()
    student = copy.deepcopy(original)  # outside the scope: still the strategy's (tests/values/test_variables.py)
    _assert_equal_params(_train(student, _mlp_loss, _mlp_data(), strategy), _train(_mlp(), _mlp_loss, _mlp_data()))
    _assert_equal_params(original, _mlp())  # training the copy left the original alone


def test_a_deep_copied_batchnorm_keeps_per_replica_buffers(strategy):
    with strategy.scope():
        norm = nn.BatchNorm1d(3)
    with torch.no_grad():
        for i, component in enumerate(norm.running_mean.values):
            component.fill_(float(i + 1))
    copied = copy.deepcopy(norm)
    assert type(copied.running_mean) is type(norm.running_mean) and copied.running_mean is not norm.running_mean
    for mine, theirs in zip(copied.running_mean.values, norm.running_mean.values):
        torch.testing.assert_close(mine, theirs)
        assert mine.data_ptr() != theirs.data_ptr()


def test_load_state_dict_assign_outside_the_scope_joins(strategy):
    with strategy.scope():
        model = _mlp()
    torch.manual_seed(5)
    checkpoint = {k: v.clone()
                  for k, v in nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).state_dict().items()}
    model.load_state_dict(checkpoint, assign=True)
    want = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    want.load_state_dict(checkpoint)
    _assert_equal_params(_train(model, _mlp_loss, _mlp_data(), strategy), _train(want, _mlp_loss, _mlp_data()))


def test_to_empty_then_load_keeps_the_variables(strategy):
    with strategy.scope():
        model = _mlp()
    values = {k: v.clone() for k, v in model.state_dict().items()}
    model.to_empty(device="cpu")
    model.load_state_dict(values)
    _assert_equal_params(_train(model, _mlp_loss, _mlp_data(), strategy), _train(_mlp(), _mlp_loss, _mlp_data()))


class _Symmetric(nn.Module):
    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return (weight + weight.t()) / 2


@pytest.mark.parametrize("where", ["in_scope", "outside"])
def test_a_parametrization_registered_later_trains_as_on_one_device(strategy, where):
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))
    torch.manual_seed(0)
    want = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))
    with strategy.scope() if where == "in_scope" else torch.no_grad():
        parametrize.register_parametrization(model[0], "weight", _Symmetric())
    parametrize.register_parametrization(want[0], "weight", _Symmetric())
    _assert_equal_params(_train(model, _mlp_loss, _mlp_data(), strategy), _train(want, _mlp_loss, _mlp_data()))


def test_a_parameter_added_in_the_scope_joins(strategy):
    with strategy.scope():
        model = _mlp()
    with strategy.scope():
        model[2].register_parameter("offset", nn.Parameter(torch.zeros(3)))
    want = _mlp()
    want[2].register_parameter("offset", nn.Parameter(torch.zeros(3)))
    _assert_equal_params(_train(model, _mlp_loss, _mlp_data(), strategy), _train(want, _mlp_loss, _mlp_data()))


def test_a_parameter_added_outside_the_scope_is_refused_at_the_first_step(strategy):
    with strategy.scope():
        model = _mlp()
    model[2].register_parameter("offset", nn.Parameter(torch.zeros(3)))
    with pytest.raises(UsageError,
                       match=r"1 of the optimizer's 5 parameters \(#4 \(3,\)\).*inside `with strategy.scope\(\):`"):
        _train(model, _mlp_loss, _mlp_data(1), strategy)


def test_a_model_built_outside_the_scope_is_refused_when_stepped_in_run(strategy):
    model = _mlp()  # plain: both replica threads would train one tensor
    with pytest.raises(UsageError, match=r"4 of the optimizer's 4 parameters .* not synchronised by"):
        _train(model, _mlp_loss, _mlp_data(1), strategy)


def test_copies_inside_run_or_another_strategys_scope_are_refused(strategy):
    with strategy.scope():
        model = _mlp()
    with pytest.raises(UsageError, match="copy.deepcopy of a distributed parameter .* inside strategy.run"):
        strategy.run(lambda: copy.deepcopy(model))
    with unison.MirroredStrategy(["cpu:0", "cpu:1"]).scope():
        with pytest.raises(ValueError, match="inside the scope of another strategy"):
            copy.deepcopy(model)


def test_a_plain_parameter_listed_first_is_refused_too(strategy):
    # The step finds its synchroniser through the optimizer's first parameter: a plain one
    # there must not hide the strategy's parameters after it.
    with strategy.scope():
        model = _mlp()
    offset = nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([offset, *model.parameters()], lr=0.1)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        _mlp_loss(model, x, y).backward()
        opt.step()

    x, y = _mlp_data(1)[0]
    with pytest.raises(UsageError, match=r"1 of the optimizer's 5 parameters \(#0 \(3,\)\) .* strategy of its other"):
        strategy.run(step, args=tuple(unison.PerReplica(list(t.chunk(2))) for t in (x, y)))
