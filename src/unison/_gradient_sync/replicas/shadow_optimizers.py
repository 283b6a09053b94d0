"""Copies of a user's optimizer that step other tensors: the replicas' shadows.

A shadow is a shallow copy of the user's optimizer (its class, defaults and step code)
over other parameter groups and its own state mapping, without the user's step hooks
(those run once, on the user's optimizer). Before each step it takes the user's current
hyperparameters, so learning-rate schedulers reach every replica.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any

import torch

__all__ = ["shadow_optimizer", "follow_hyperparameters"]


def shadow_optimizer(optimizer: torch.optim.Optimizer, param_groups: list[dict[str, Any]],
                     state: Any) -> torch.optim.Optimizer:
    """A copy of ``optimizer`` stepping ``param_groups`` with ``state``, without step hooks."""
    shadow = copy.copy(optimizer)
    shadow.state = state
    shadow._optimizer_step_pre_hooks = OrderedDict()
    shadow._optimizer_step_post_hooks = OrderedDict()
    shadow.param_groups = param_groups
    shadow.__dict__.pop("zero_grad", None)  # the user's instance's replica zero_grad (replica_zero_grad.py)
    return shadow


def follow_hyperparameters(shadow: torch.optim.Optimizer, optimizer: torch.optim.Optimizer) -> None:
    """Copies every group's hyperparameters (all but ``params``) from ``optimizer`` to ``shadow``."""
    for shadow_group, group in zip(shadow.param_groups, optimizer.param_groups):
        for key, value in group.items():
            if key != "params":
                shadow_group[key] = value
