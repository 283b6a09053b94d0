"""Random fills of GPU variables in a scope draw from the CPU generator (``_interpose/initial_draws.py``).

Without a GPU, a ``meta`` tensor stands in for one: it is off the CPU and holds no
values, so what these tests see is which generator the fill consumed.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import unison
from unison._interpose.initial_draws import RANDOM_FILLS, CpuDrawnFills
from unison._state import STATE

pytestmark = pytest.mark.timeout(30)


def _next_draw_after(fill) -> torch.Tensor:
    torch.manual_seed(3)
    fill()
    return torch.rand(4)


def _plain_kaiming() -> None:
    nn.init.kaiming_uniform_(torch.empty(6, 5), a=1.0)


def _untouched() -> None:
    pass


@pytest.mark.parametrize("fill", [lambda t: nn.init.kaiming_uniform_(t, a=1.0),
                                  lambda t: nn.init.kaiming_uniform_(tensor=t, a=1.0)],
                         ids=["positional", "keyword"])
def test_a_fill_in_cross_replica_scope_draws_what_plain_pytorch_draws_on_the_cpu(fill):
    strategy = unison.OneDeviceStrategy("cpu:0")

    def in_scope() -> None:
        with strategy.scope(), CpuDrawnFills():
            fill(torch.empty(6, 5, device="meta"))

    assert torch.equal(_next_draw_after(in_scope), _next_draw_after(_plain_kaiming))
    assert not torch.equal(_next_draw_after(in_scope), _next_draw_after(_untouched))


def test_tensor_method_fills_are_redirected_too():
    def in_scope() -> None:
        with unison.OneDeviceStrategy("cpu:0").scope(), CpuDrawnFills():
            torch.empty(10, device="meta").normal_(0.0, 2.0)

    assert torch.equal(_next_draw_after(in_scope), _next_draw_after(lambda: torch.empty(10).normal_(0.0, 2.0)))


def test_fills_outside_a_scope_and_of_cpu_tensors_are_left_alone():
    def outside() -> None:
        with CpuDrawnFills():
            nn.init.kaiming_uniform_(torch.empty(6, 5, device="meta"), a=1.0)

    assert torch.equal(_next_draw_after(outside), _next_draw_after(_untouched))
    with unison.OneDeviceStrategy("cpu:0").scope(), CpuDrawnFills():
        torch.manual_seed(3)
        t = torch.empty(6, 5)
        nn.init.kaiming_uniform_(t, a=1.0)
    torch.manual_seed(3)
    assert torch.equal(t, nn.init.kaiming_uniform_(torch.empty(6, 5), a=1.0))


def test_only_gpu_strategies_open_the_mode_in_their_scope():
    assert not unison.MirroredStrategy(["cpu:0", "cpu:1"])._draws_off_the_cpu()
    with unison.OneDeviceStrategy("cpu:0").scope():
        assert not torch.overrides._get_current_function_mode_stack()


def test_steps_run_without_the_mode():
    strategy = unison.OneDeviceStrategy("cpu:0")
    seen = []
    with strategy.scope(), CpuDrawnFills():
        strategy.run(lambda: seen.append(len(torch.overrides._get_current_function_mode_stack())))
        seen.append(len(torch.overrides._get_current_function_mode_stack()))
    assert seen == [0, 1]  # off during the step, back after it


def _guarded(original):
    """A library's stand-in for an ``nn.init`` fill, as Transformers' ``guard_torch_init_functions``
    installs while it builds a model: it skips tensors flagged as initialised."""
    def normal_(tensor, mean=0.0, std=1.0, generator=None):
        if not getattr(tensor, "_is_initialized", False):
            return original(tensor, mean=mean, std=std, generator=generator)
        return tensor
    return normal_


def test_a_fill_a_library_swapped_into_nn_init_is_redirected_too(monkeypatch):
    """``nn.init.normal_`` dispatches to the mode through the name it holds at call time, so
    the mode receives the library's wrapper, which draws on the GPU unless it is recognised."""
    original = nn.init.normal_
    monkeypatch.setattr(nn.init, "normal_", _guarded(original))

    def in_scope() -> None:
        with unison.OneDeviceStrategy("cpu:0").scope(), CpuDrawnFills():
            original(torch.empty(10, device="meta"), std=2.0)  # torch's own, as the wrapper calls it

    assert torch.equal(_next_draw_after(in_scope), _next_draw_after(lambda: original(torch.empty(10), std=2.0)))


def test_a_swapped_fill_that_skips_a_tensor_leaves_it_and_draws_nothing(monkeypatch):
    from unison._interpose import initial_draws

    original = nn.init.normal_
    monkeypatch.setattr(nn.init, "normal_", _guarded(original))
    flagged = torch.empty(10, device="meta")
    flagged._is_initialized = True

    def in_scope() -> None:
        with unison.OneDeviceStrategy("cpu:0").scope(), CpuDrawnFills():
            original(flagged)

    assert torch.equal(_next_draw_after(in_scope), _next_draw_after(_untouched))
    # the values of a skipped tensor stay (a CPU target: meta tensors hold none)
    target = torch.arange(4.0)
    target._is_initialized = True
    initial_draws._fill_on_cpu(nn.init.normal_, target, (target,), {}, keep_values=True)
    assert torch.equal(target, torch.arange(4.0))


_FILL_NAMES = {f.__name__ for f in RANDOM_FILLS}


class _FillsOnParameters(TorchFunctionMode):
    """Pushed below ``CpuDrawnFills``: sees what that mode passes on, and records the random
    fills that reach a parameter itself (on a GPU they would draw from the GPU's generator)."""

    def __init__(self) -> None:
        super().__init__()
        self.escaped: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")
        fill = func in RANDOM_FILLS or getattr(func, "__name__", None) in _FILL_NAMES  # or a library's stand-in
        if fill and isinstance(target, nn.Parameter):
            self.escaped.append(func.__name__)
        return func(*args, **kwargs)


def test_every_fill_of_a_transformers_model_in_a_gpu_scope_is_drawn_on_the_cpu(monkeypatch):
    """Transformers swaps ``nn.init``'s functions for guarded ones while it builds a model
    (``guard_torch_init_functions``); on an H200 a GPT-2 built in ``OneDeviceStrategy("cuda:0")``'s
    scope started from other weights than plain PyTorch's. Here CPU parameters stand in for
    GPU ones (the mode is told they are off the CPU): no fill may reach a parameter itself,
    and the weights are plain PyTorch's."""
    from tests.real_models import _harness as h
    from unison._interpose import initial_draws

    if h.importlib.util.find_spec("transformers") is None:
        pytest.skip(f"transformers not installed: {h.INSTALL_HINT}")
    transformers = h.import_transformers()
    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=8,
                                     bos_token_id=0, eos_token_id=0)
    monkeypatch.setattr(initial_draws, "_draw_on_cpu", lambda target, generator: isinstance(target, nn.Parameter))
    detector = _FillsOnParameters()
    torch.manual_seed(0)
    with detector, STATE.push(unison.OneDeviceStrategy("cpu:0"), None), CpuDrawnFills():
        model = transformers.GPT2LMHeadModel(config)
    assert detector.escaped == []
    torch.manual_seed(0)
    plain = transformers.GPT2LMHeadModel(config)
    for (name, got), want in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(got, want), name
