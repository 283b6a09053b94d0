"""A ps task's memory: large request buffers go back to the system when freed.

A ps task answers each request with tensors of a batch's size (rows made, gathered,
updated: megabytes) from several session threads. glibc's malloc serves blocks above a
threshold with ``mmap`` and returns them on free, but raises that threshold (up to 32 MB)
each time such a block is freed; after that the same buffers come from per-thread heaps,
where freed memory stays resident. The process then holds several batches' worth of
freed memory beside its tables: ``tests/ps/test_table_memory.py`` measured 297 MB of RSS
growth on a ps task for 128 MB of new rows and optimizer state (154 MB of table with its
index and counters). Fixing the threshold at 1 MB keeps every batch buffer an ``mmap``
of its own, so the resident size follows the tables: 154 MB in the same test. Workers
keep glibc's default: there every freed buffer of a megabyte or more would be mapped and
faulted in again at the next step (``benchmarks/parameter_server.py``'s dense workload
ran 7-9% slower with it), and a worker's memory follows its batch, not the tables.
"""

from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["release_large_buffers"]

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
_THRESHOLD_BYTES = 1 << 20


def release_large_buffers() -> bool:
    """Fixes glibc's mmap threshold at 1 MB in this process; False where there is no glibc."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(_M_MMAP_THRESHOLD, _THRESHOLD_BYTES))
