"""A default intra-op thread count from the task's CPU share, where no launcher chose one.

torchrun and ``unison launch`` start each process with ``OMP_NUM_THREADS=1``; ``srun``
sets nothing, so every task of a node takes all of its cores: 2 tasks on 2 cores ran
4-5x slower than with one thread each. When the resolved cluster knows the task's CPU
share (under SLURM: ``SLURM_CPUS_PER_TASK``, else the CPUs this process may run on
divided by the tasks on its host) and the user chose nothing (``OMP_NUM_THREADS`` unset
and ``torch.set_num_threads`` not called since unison was imported), the worker group's
formation lowers torch's intra-op threads to that share, once per process, and says so
with a :class:`ThreadsDefaultWarning`. It never raises the count.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Mapping

import torch

from unison._cluster import env

__all__ = ["ThreadsDefaultWarning", "ThreadDefault", "THREAD_DEFAULT", "cpu_share", "usable_cpus"]


class ThreadsDefaultWarning(UserWarning):
    """unison lowered torch's intra-op threads to the task's CPU share (set ``OMP_NUM_THREADS`` to choose)."""


def usable_cpus() -> int:
    """How many CPUs this process may run on (its affinity; all of them off Linux)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def cpu_share(cpus_per_task: int | None, tasks_on_host: int, affinity: int | None = None) -> int:
    """CPUs one task may use: ``cpus_per_task`` if known, else its part of the usable CPUs.

    Args:
        cpus_per_task: the scheduler's CPUs per task (``SLURM_CPUS_PER_TASK``), or None.
        tasks_on_host: tasks of the cluster on this host (at least 1).
        affinity: CPUs this process may run on (default: ``os.sched_getaffinity``).

    Returns:
        At least 1, and never more than ``affinity``.
    """
    usable = usable_cpus() if affinity is None else affinity
    share = cpus_per_task if cpus_per_task is not None else usable // max(1, tasks_on_host)
    return max(1, min(share, usable))


class ThreadDefault:
    """Applies the default thread count at most once per process (one default instance).

    The count torch had when this object was made is the untouched default: a different
    count later means the user called ``torch.set_num_threads`` and is left alone.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done = False
        self._initial = torch.get_num_threads()

    def apply(self, share: int | None, task: str, environ: Mapping[str, str] | None = None) -> int | None:
        """Lowers torch's intra-op threads to ``share`` unless the user chose a count.

        Args:
            share: the task's CPU share (``ResolvedCluster.cpu_share``), or None for none.
            task: the task's name, for the message.
            environ: the environment (default ``os.environ``), for ``OMP_NUM_THREADS``.

        Returns:
            The thread count set, or None when nothing was changed.
        """
        with self._lock:
            if self._done or share is None:
                return None
            self._done = True
            current = torch.get_num_threads()
            if env.thread_setting(environ) is not None or current != self._initial or current <= share:
                return None
            torch.set_num_threads(share)
        warnings.warn(
            f"unison set torch's intra-op threads of {task} to {share} (its CPU share: SLURM_CPUS_PER_TASK, "
            f"else the usable CPUs divided by the tasks on this host), from {current}: with no launcher setting "
            f"them every task would use all cores and slow the others down; set OMP_NUM_THREADS (or call "
            f"torch.set_num_threads before building the strategy) to choose another count",
            ThreadsDefaultWarning,
            stacklevel=2,
        )
        return share


#: The process's one instance; tests may build their own.
THREAD_DEFAULT = ThreadDefault()
