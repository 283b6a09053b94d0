"""The changes unison makes to ``torch.nn``: registration hooks and ``nn.Parameter.__deepcopy__``.

The behaviour is the owners' (``_strategies/scope_hooks.py``, ``_strategies/joining.py``,
``ps/policy.py``): a parameter or buffer registered in a strategy's scope becomes its
variable, a deep copy of a parameter a multi-worker strategy synchronises is synchronised
too, and ``place_parameters_in`` sees which modules a block builds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from unison._interpose.registry import Interposition, ScopedInterposition

__all__ = ["ORIGINAL_PARAMETER_DEEPCOPY", "observed_registrations", "parameter_copy_hook", "registration_hooks"]

RegistrationHook = Callable[[nn.Module, str, Any], Any]

ORIGINAL_PARAMETER_DEEPCOPY: Callable[[nn.Parameter, dict], nn.Parameter] = nn.Parameter.__deepcopy__
"""torch's own ``nn.Parameter.__deepcopy__``, which the replacement calls first."""


def _register(on_parameter: RegistrationHook, on_buffer: RegistrationHook) -> None:
    nn.modules.module.register_module_parameter_registration_hook(on_parameter)
    nn.modules.module.register_module_buffer_registration_hook(on_buffer)


registration_hooks = Interposition(
    "global module parameter/buffer registration hooks", "torch.nn.Module (every instance)",
    "parameters and buffers of modules built in a strategy's scope become its variables", _register)


def _replace_deepcopy(copy: Callable[[nn.Parameter, dict], nn.Parameter]) -> None:
    setattr(nn.Parameter, "__deepcopy__", copy)  # noqa: B010 - a method of torch's class, replaced (mypy refuses the assignment)


parameter_copy_hook = Interposition(
    "nn.Parameter.__deepcopy__", "torch.nn.Parameter (the class)",
    "a deep copy of a parameter a multi-worker strategy synchronises is synchronised too", _replace_deepcopy)


@contextlib.contextmanager
def _observe(on_module: RegistrationHook, on_parameter: RegistrationHook) -> Iterator[None]:
    handles = [nn.modules.module.register_module_module_registration_hook(on_module),
               nn.modules.module.register_module_parameter_registration_hook(on_parameter),
               nn.modules.module.register_module_buffer_registration_hook(on_parameter)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


observed_registrations = ScopedInterposition(
    "global module/parameter/buffer registration hooks for one block", "torch.nn.Module (every instance)",
    "ParameterServerStrategy's place_parameters_in must see which modules the block builds, "
    "to place their parameters by name", _observe)
