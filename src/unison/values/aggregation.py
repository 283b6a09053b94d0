"""VariableAggregation and VariableSynchronization enums (tf.VariableAggregation, tf.VariableSynchronization)."""

from __future__ import annotations

import enum

from unison.reduce import ReduceOp

__all__ = ["VariableAggregation", "VariableSynchronization"]


class VariableAggregation(enum.Enum):
    """How replica-context writes to a variable are combined (``tf.VariableAggregation``).

    ``NONE`` forbids replica-context writes to mirrored variables; ``SUM`` / ``MEAN``
    reduce the replicas' writes; ``ONLY_FIRST_REPLICA`` keeps replica 0's write.
    """

    NONE = "NONE"
    SUM = "SUM"
    MEAN = "MEAN"
    ONLY_FIRST_REPLICA = "ONLY_FIRST_REPLICA"

    @classmethod
    def from_any(cls, value: "VariableAggregation | str") -> "VariableAggregation":
        """Returns the member for an enum member or a case-insensitive name."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value.upper()]
        raise ValueError(
            f"aggregation {value!r} is not a VariableAggregation: use one of "
            f"{', '.join(cls.__members__)}"
        )

    def reduce_op(self) -> ReduceOp | None:
        """The ReduceOp that implements this aggregation, or None for NONE/ONLY_FIRST_REPLICA."""
        return {VariableAggregation.SUM: ReduceOp.SUM, VariableAggregation.MEAN: ReduceOp.MEAN}.get(self)


class VariableSynchronization(enum.Enum):
    """When a distributed variable's components are synchronised (``tf.VariableSynchronization``).

    ``AUTO`` and ``ON_WRITE`` give a MirroredVariable (every write reaches every
    component); ``ON_READ`` gives a SyncOnReadVariable (each replica writes its own
    component, a cross-replica read aggregates); ``NONE`` is treated like ``ON_READ``
    with aggregation ``ONLY_FIRST_REPLICA`` semantics left to the user.
    """

    AUTO = "AUTO"
    NONE = "NONE"
    ON_WRITE = "ON_WRITE"
    ON_READ = "ON_READ"

    @classmethod
    def from_any(cls, value: "VariableSynchronization | str") -> "VariableSynchronization":
        """Returns the member for an enum member or a case-insensitive name."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value.upper()]
        raise ValueError(
            f"synchronization {value!r} is not a VariableSynchronization: use one of "
            f"{', '.join(cls.__members__)}"
        )
