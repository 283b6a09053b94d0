"""Giving freed heap memory back to the system after a disk tier's writes (glibc's ``malloc_trim``).

LMDB copies each page a write transaction changes into memory it mallocs, on the thread
that writes (``row_writer``). A spill of thousands of rows dirties megabytes of pages; once
committed they are freed, but glibc keeps freed memory in the thread's heap, so a ps task
whose table is capped by a memory budget held 12 MB of it beside a 22 MB budget
(``benchmarks/disk_tier.py``). ``malloc_trim(0)`` returns the free pages of every heap;
ctypes releases the GIL during the call, so it costs the training thread nothing.
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
