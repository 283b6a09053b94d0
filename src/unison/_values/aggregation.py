"""VariableAggregation and VariableSynchronization enums (tf.VariableAggregation, tf.VariableSynchronization)."""

from __future__ import annotations

from unison._enums import NamedEnum
from unison._reduce import ReduceOp

__all__ = ["VariableAggregation", "VariableSynchronization"]


class VariableAggregation(NamedEnum):
    """How replica-context writes to a variable are combined (``tf.VariableAggregation``).

    ``NONE`` forbids replica-context writes to mirrored variables; ``SUM`` / ``MEAN``
    reduce the replicas' writes; ``ONLY_FIRST_REPLICA`` keeps replica 0's write.
    """

    NONE = "NONE"
    SUM = "SUM"
    MEAN = "MEAN"
    ONLY_FIRST_REPLICA = "ONLY_FIRST_REPLICA"

    @classmethod
    def _argument_name(cls) -> str:
        return "aggregation"

    def reduce_op(self) -> ReduceOp | None:
        """The ReduceOp that implements this aggregation, or None for NONE/ONLY_FIRST_REPLICA."""
        return {VariableAggregation.SUM: ReduceOp.SUM, VariableAggregation.MEAN: ReduceOp.MEAN}.get(self)


class VariableSynchronization(NamedEnum):
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
    def _argument_name(cls) -> str:
        return "synchronization"

