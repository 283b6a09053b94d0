"""ReduceOp: how values from several replicas are combined."""

from __future__ import annotations

from unison._enums import NamedEnum

__all__ = ["ReduceOp"]


class ReduceOp(NamedEnum):
    """How to combine values across replicas (``tf.distribute.ReduceOp``).

    ``SUM`` adds the replicas' values; ``MEAN`` adds and divides by the number of
    replicas. Every unison API that takes a reduce op also accepts the name as a
    string in any case (``"sum"``, ``"MEAN"``).
    """

    SUM = "SUM"
    MEAN = "MEAN"

    @classmethod
    def _argument_name(cls) -> str:
        return "reduce_op"

