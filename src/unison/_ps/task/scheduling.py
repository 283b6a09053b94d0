"""A ps session thread's CPU scheduling: ``SCHED_BATCH``, so that a request arriving never preempts a worker.

Linux lets a task that wakes on a CPU preempt the task running there. A ps session thread
wakes at every request, and on a host that it shares with workers (``unison launch
--workers N --ps M`` on one machine) it then took the CPU from the worker that had just
sent the request, before that worker could send the same lookup's request to the next ps
task: the ps tasks worked one after the other, and each worker was switched out about five
times a global step (the hybrid DLRM of ``benchmarks/recsys.py``, 2 workers and 2 ps tasks
on 2 cores). ``SCHED_BATCH`` is the kernel's policy for throughput work: such a thread runs
as before, on an idle CPU at once, but its wakeup does not preempt a running task. There the
job ran about 10% faster (``benchmarks/RESULTS.md``); on a ps task's own host it changes
only the order among its own threads.

Only the session threads take it (and threads they start, which inherit it), not the
process: a ps server started inside another program (a test, a notebook) leaves that
program's threads as they were. Unprivileged since Linux 2.6.16; ``UNISON_PS_SCHED_BATCH=0``
keeps the default policy.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from unison._cluster.env import ps_sched_batch

__all__ = ["serve_at_batch_priority"]

logger = logging.getLogger(__name__)


def serve_at_batch_priority(environ: Mapping[str, str] | None = None) -> bool:
    """Puts the calling thread under ``SCHED_BATCH``; returns whether it did.

    False where ``UNISON_PS_SCHED_BATCH`` is "0", off Linux, or where the kernel refused
    (the thread keeps its policy then).
    """
    if not ps_sched_batch(environ) or not hasattr(os, "SCHED_BATCH"):
        return False
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))  # 0: the calling thread
    except OSError as e:
        logger.debug("a ps session keeps its CPU scheduling policy: sched_setscheduler(SCHED_BATCH) failed (%s)", e)
        return False
    return True
