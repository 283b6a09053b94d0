"""Argument checks shared by the input modules (private)."""

from __future__ import annotations

__all__ = ["require_int"]


def require_int(field: str, value: object, *, minimum: int) -> int:
    """Returns ``value`` if it is an int (not a bool) of at least ``minimum``.

    Raises:
        TypeError: if ``value`` is not an int.
        ValueError: if ``value`` is below ``minimum``.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{field}` must be an int, got {type(value).__name__}: {value!r}")
    if value < minimum:
        raise ValueError(f"`{field}` must be at least {minimum}, got {value!r}")
    return value
