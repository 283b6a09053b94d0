"""ReduceOp: how values from several replicas are combined."""

from __future__ import annotations

import enum

__all__ = ["ReduceOp"]


class ReduceOp(enum.Enum):
    """How to combine values across replicas (``tf.distribute.ReduceOp``).

    ``SUM`` adds the replicas' values; ``MEAN`` adds and divides by the number of
    replicas. Every unison API that takes a reduce op also accepts the name as a
    string in any case (``"sum"``, ``"MEAN"``).
    """

    SUM = "SUM"
    MEAN = "MEAN"

    @classmethod
    def from_any(cls, value: "ReduceOp | str") -> "ReduceOp":
        """Returns the member for an enum member or a case-insensitive name."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value.upper()]
        raise ValueError(
            f"reduce_op {value!r} is not a ReduceOp: use ReduceOp.SUM, ReduceOp.MEAN "
            f"or one of the strings 'SUM', 'MEAN' (any case)"
        )
