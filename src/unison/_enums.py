"""NamedEnum: enums that also accept their members' names as strings, in any case."""

from __future__ import annotations

import enum
from typing import TypeVar

__all__ = ["NamedEnum"]

E = TypeVar("E", bound="NamedEnum")


class NamedEnum(enum.Enum):
    """Base of unison's option enums: ``ReduceOp.from_any("mean") is ReduceOp.MEAN``.

    Subclasses name the argument they are passed as in ``_argument_name`` so the error
    says which argument was wrong.
    """

    @classmethod
    def _argument_name(cls) -> str:
        return cls.__name__

    @classmethod
    def from_any(cls: type[E], value: E | str) -> E:
        """Returns the member for an enum member or a case-insensitive name.

        Raises:
            ValueError: naming the argument, the value and the valid names.
        """
        if isinstance(value, cls):
            return value
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value.upper()]
        raise ValueError(
            f"{cls._argument_name()} {value!r} is not a {cls.__name__}: use one of "
            f"{', '.join(cls.__members__)} (a {cls.__name__} member, or its name as a string in any case)"
        )
