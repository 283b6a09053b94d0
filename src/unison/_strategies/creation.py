"""``unison.Variable``: a variable that follows the current strategy (``tf.Variable``)."""

from __future__ import annotations

from typing import Any

import torch

from unison._state import STATE
from unison._values.aggregation import VariableAggregation, VariableSynchronization

__all__ = ["Variable"]


def Variable(  # noqa: N802 - named like tf.Variable on purpose
    initial_value: Any,
    *,
    trainable: bool | None = None,
    name: str | None = None,
    synchronization: VariableSynchronization | str = VariableSynchronization.AUTO,
    aggregation: VariableAggregation | str = VariableAggregation.NONE,
) -> torch.Tensor:
    """Creates a variable: a plain tensor outside any strategy, a distributed one inside ``scope()``.

    Args:
        initial_value: a tensor, number or nested list.
        trainable: whether it takes gradients; default True, False for ON_READ.
        name: a name shown in errors and reprs.
        synchronization: ON_WRITE/AUTO gives a MirroredVariable, ON_READ a SyncOnReadVariable.
        aggregation: how replica-context writes (mirrored) or cross-replica reads
            (sync-on-read) combine the replicas' values.

    Raises:
        ValueError: for a trainable ON_READ variable, or unknown enum names.
    """
    synchronization = VariableSynchronization.from_any(synchronization)
    aggregation = VariableAggregation.from_any(aggregation)
    if synchronization is VariableSynchronization.NONE:
        synchronization = VariableSynchronization.ON_READ
        if aggregation is VariableAggregation.NONE:
            aggregation = VariableAggregation.ONLY_FIRST_REPLICA
    if trainable is None:
        trainable = synchronization is not VariableSynchronization.ON_READ
    elif trainable and synchronization is VariableSynchronization.ON_READ:
        raise ValueError(
            f"variable {name!r}: synchronization=ON_READ is only for non-trainable variables "
            f"(metrics, statistics), got trainable=True; pass trainable=False or use ON_WRITE"
        )
    value = initial_value.detach().clone() if isinstance(initial_value, torch.Tensor) else torch.tensor(initial_value)
    if value.is_floating_point() is False and trainable and synchronization is not VariableSynchronization.ON_READ:
        trainable = False
    entry = STATE.top()
    if entry is None or entry.strategy.extended.components.is_default:
        return value.requires_grad_(trainable)
    if entry.replica_context is not None:
        raise ValueError(
            f"variable {name!r} created inside strategy.run: create variables in cross-replica context, "
            f"inside `with strategy.scope():` before calling run"
        )
    return entry.strategy.extended.create_variable(
        value, trainable=trainable, name=name, synchronization=synchronization, aggregation=aggregation
    )
