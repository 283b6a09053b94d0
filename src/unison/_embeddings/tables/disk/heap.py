"""Giving freed heap memory back to the system after a disk tier's step over its budget (glibc's ``malloc_trim``).

A step that makes more rows than the budget holds (a load, a large batch) grows the hot
table's slots; once they spill and the table compacts, the old slots are freed, but glibc
keeps freed memory in the heap it came from. ``malloc_trim(0)`` returns the free pages of
every heap; ctypes releases the GIL during the call, so it costs another thread nothing.
(LMDB's page copies of a write transaction, which this was first for, live in the store's
writer process now: ``writer_process``.)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable

__all__ = ["trim_heap"]


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def trim_heap() -> bool:
    """Returns the process's free heap pages to the system; False where there is no glibc."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
