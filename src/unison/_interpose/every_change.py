"""Every change unison makes to PyTorch, in one literal list.

Read it to learn what unison changes in torch: each entry says what, on which torch
class or instances, why, and whether it is in effect in this process. A change that is
not listed here does not exist (``tests/architecture/test_interpositions.py`` finds every
interposition defined in ``unison._interpose`` and every torch change made outside it).
"""

from __future__ import annotations

from unison._interpose import (
    grad_scaler,
    initial_draws,
    module_hooks,
    once_per_step,
    optimizer_hooks,
    replica_parameters,
)
from unison._interpose.registry import InstanceInterposition, Interposition, ScopedInterposition

__all__ = ["INTERPOSITIONS"]

INTERPOSITIONS: tuple[Interposition | ScopedInterposition | InstanceInterposition, ...] = (
    module_hooks.registration_hooks,
    module_hooks.parameter_copy_hook,
    module_hooks.observed_registrations,
    optimizer_hooks.step_hooks,
    optimizer_hooks.step_post_hook,
    optimizer_hooks.replica_zero_grad,
    optimizer_hooks.optimizer_state_wrappers,
    grad_scaler.install_grad_scaler_replicas,
    once_per_step.install_once_per_step,
    initial_draws.cpu_drawn_fills,
    replica_parameters.replica_parameter_dicts,
)
"""Every change, global, scoped or per instance: what, where, why, and whether it is in effect."""
