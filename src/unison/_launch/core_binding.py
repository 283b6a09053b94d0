"""``unison launch --bind-cores``: each task of this host on CPUs of its own.

Unbound, the kernel places a host's tasks and their threads wherever it likes. That costs
where a task's threads hand work to each other: a hybrid worker that serves a ps task in
its own process (``--ps-in-workers``) waits for its own ps session thread, and the two
threads, on either core, blocked and woke each other about twice as often as bound to one.
On the 2-core VM the hybrid DLRM left 11-12% of the machine idle unbound, 2% bound, and ran
1.15x faster bound (``benchmarks/RESULTS.md``); a MultiWorkerMirrored job gained nothing.
DeepSpeed's ``--bind_cores_to_rank`` and torch's ``torch.backends.xeon.run_cpu`` bind CPU
training the same way.

The CPUs the launcher may run on (its affinity) are split into one contiguous range per
task, in task order; each task's process starts with its range as affinity, and every
thread and process it starts inherits it (a data loader's workers too: give a task
several CPUs, or do not bind, where they should run beside it). Off by default: two jobs
bound on one machine would each take the same first CPUs.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import TypeVar

__all__ = ["plan_cores", "describe_plan", "started_on"]

_Key = TypeVar("_Key")


def plan_cores(tasks: Sequence[_Key], cpus: Sequence[int] | None = None) -> dict[_Key, tuple[int, ...]]:
    """Each task's CPUs: ``cpus`` (default: this process's affinity, sorted) split into one
    contiguous range per task, in order, the first ranges one CPU longer where they do not divide.

    Raises:
        ValueError: when there are more tasks than CPUs (a task would get none), naming both counts;
            off Linux (no CPU affinity to set).
    """
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError("--bind-cores sets each task's CPU affinity, which this platform does not offer (Linux "
                         "does); drop --bind-cores")
    usable = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if len(tasks) > len(usable):
        raise ValueError(
            f"--bind-cores gives every task of this host CPUs of its own, but {len(tasks)} tasks would share "
            f"{len(usable)} CPU(s) (this launcher may run on CPUs {_ranges(usable)}); start fewer tasks on this "
            f"host (e.g. --ps-in-workers instead of ps processes), or drop --bind-cores")
    share, extra = divmod(len(usable), len(tasks)) if tasks else (0, 0)
    plan: dict[_Key, tuple[int, ...]] = {}
    start = 0
    for position, task in enumerate(tasks):
        size = share + (1 if position < extra else 0)
        plan[task] = tuple(usable[start:start + size])
        start += size
    return plan


def describe_plan(plan: Mapping[str, Sequence[int]]) -> str:
    """``"worker:0 on CPU 0, worker:1 on CPUs 1-3"``: the launcher's message, by task name."""
    return ", ".join(f"{name} on CPU{'s' if len(cpus) > 1 else ''} {_ranges(cpus)}" for name, cpus in plan.items())


@contextlib.contextmanager
def started_on(cpus: Sequence[int] | None) -> Iterator[None]:
    """Runs the block (a process's start) with the calling thread bound to ``cpus``, then restores
    its affinity: a process started meanwhile inherits the binding from its first instruction,
    with no moment on other CPUs (binding it after its start would miss threads it made already).
    ``None``: unchanged."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _ranges(cpus: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    parts: list[str] = []
    ordered = sorted(cpus)
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)
