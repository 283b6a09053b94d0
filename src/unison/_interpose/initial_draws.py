"""Random initial values drawn on the CPU in a GPU strategy's scope, as plain PyTorch draws them.

Inside ``scope()`` a module's parameters move to the strategy's device as the module
registers them, before its ``reset_parameters()`` fills them: left alone, the fill would
draw from the GPU's generator, so a model built in a GPU strategy's scope would start
from other weights than the same model built as plain PyTorch (on the CPU, then moved)
or in a CPU strategy's scope, for the same seed. While such a scope is open, in
cross-replica context, this mode runs the random in-place fills (``nn.init``'s and the
tensor methods they use) on a CPU tensor of the same shape and copies the values over:
the same numbers, from the same generator state, as plain PyTorch. A fill given a GPU
generator explicitly is left on the GPU. Only this thread's ops in the scope pass
through the mode (a Python call each, a few microseconds); replica threads, code outside
the scope and ``strategy.run`` (``steps_without_fills``) never see it.

Libraries may swap ``torch.nn.init``'s functions for wrappers while they build a model
(Hugging Face Transformers' ``guard_torch_init_functions`` does, for every model it
builds); the mode then receives the wrapper, since ``nn.init`` dispatches through the name
it holds at call time. A function that ``torch.nn.init`` holds under a fill's name is a
fill too, and runs on a CPU copy of the target's values (with the target's Python
attributes), so a wrapper that skips some tensors (Transformers' ``_is_hf_initialized``)
leaves them as they were.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from unison._interpose.registry import ScopedInterposition
from unison._state import STATE

__all__ = ["CpuDrawnFills", "RANDOM_FILLS", "any_mode_active", "cpu_drawn_fills", "steps_without_fills"]

RANDOM_FILLS = frozenset({
    torch.Tensor.uniform_, torch.Tensor.normal_, torch.Tensor.bernoulli_, torch.Tensor.random_,
    torch.Tensor.exponential_, torch.Tensor.geometric_, torch.Tensor.log_normal_, torch.Tensor.cauchy_,
    nn.init.uniform_, nn.init.normal_, nn.init.trunc_normal_, nn.init.kaiming_uniform_, nn.init.kaiming_normal_,
    nn.init.xavier_uniform_, nn.init.xavier_normal_, nn.init.orthogonal_, nn.init.sparse_,
})
"""In-place fills that draw from a generator: their first argument is the tensor filled."""

_INIT_FILL_NAMES = frozenset(f.__name__ for f in RANDOM_FILLS if getattr(nn.init, f.__name__, None) is f)
"""The names under which ``torch.nn.init`` holds its random fills (a library may swap them)."""


class CpuDrawnFills(TorchFunctionMode):
    """Redirects random in-place fills of non-CPU tensors to the CPU while variables are created."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        known = func in RANDOM_FILLS
        if known or _swapped_init_fill(func):
            target = args[0] if args else kwargs.get("tensor")
            if isinstance(target, torch.Tensor) and _draw_on_cpu(target, kwargs.get("generator")):
                return _fill_on_cpu(func, target, args, kwargs, keep_values=not known)
        return func(*args, **kwargs)


def _swapped_init_fill(func: Any) -> bool:
    """Whether ``func`` is what ``torch.nn.init`` holds now under a fill's name (a library's wrapper)."""
    name = getattr(func, "__name__", None)
    return isinstance(name, str) and name in _INIT_FILL_NAMES and getattr(nn.init, name, None) is func


def _draw_on_cpu(target: torch.Tensor, generator: torch.Generator | None) -> bool:
    if target.device.type == "cpu":
        return False
    if generator is not None and generator.device.type != "cpu":
        return False  # the caller chose a GPU generator
    top = STATE.top()
    return top is not None and top.replica_context is None  # creating variables, not running a step


def _fill_on_cpu(func: Any, target: torch.Tensor, args: tuple, kwargs: dict, keep_values: bool = False) -> torch.Tensor:
    """Runs ``func`` on a CPU tensor of ``target``'s shape and copies the result over.

    ``keep_values`` (a library's wrapper, which may decide to leave the target alone): the
    CPU tensor starts as a copy of the target and carries its Python attributes."""
    values = torch.empty(target.shape, dtype=target.dtype)
    if keep_values:
        if target.device.type != "meta":
            values.copy_(target.detach())
        values.__dict__.update(getattr(target, "__dict__", {}))
    if args:
        func(values, *args[1:], **kwargs)
    else:
        func(**dict(kwargs, tensor=values))
    with torch.no_grad():
        target.copy_(values)
    return target


cpu_drawn_fills = ScopedInterposition(
    "a torch-function mode that draws random in-place fills on the CPU",
    "torch function dispatch (this thread, while a GPU strategy's scope creates variables)",
    "a model built in a GPU strategy's scope starts from the weights plain PyTorch draws for the same seed",
    CpuDrawnFills)


def any_mode_active() -> bool:
    """Whether this thread has a torch-function mode pushed (cheap: one C call)."""
    return bool(torch._C._len_torch_function_stack())


@contextlib.contextmanager
def steps_without_fills() -> Iterator[None]:
    """Takes the mode off this thread while a step runs (a training loop inside the scope
    would otherwise pay the mode's Python call on every op); a no-op without it."""
    depth = torch._C._len_torch_function_stack()
    if depth and isinstance(torch._C._get_function_stack_at(depth - 1), CpuDrawnFills):
        with torch.overrides._pop_mode_temporarily():
            yield
    else:
        yield
