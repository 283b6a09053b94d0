"""Random fills of GPU variables in a scope draw from the CPU generator (``strategies/initial_draws.py``).

Without a GPU, a ``meta`` tensor stands in for one: it is off the CPU and holds no
values, so what these tests see is which generator the fill consumed.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import unison
from unison.strategies.initial_draws import CpuDrawnFills

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
