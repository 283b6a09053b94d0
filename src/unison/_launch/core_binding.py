"""``unison launch --bind-cores``: each task of this host on CPUs of its own.

Unbound, the kernel places a host's tasks and their threads wherever it likes. That costs
where a task's threads hand work to each other: a hybrid worker that serves a ps task in
its own process (``--ps-in-workers``) waits for its own ps session thread, and the two
threads, on either core, blocked and woke each other about twice as often as bound to one.
On the 2-core VM the hybrid DLRM left 11-12% of the machine idle unbound, 2% bound, and ran
1.15-1.19x faster bound (``benchmarks/RESULTS.md``); a MultiWorkerMirrored job gained little.
DeepSpeed's ``--bind_cores_to_rank`` and torch's ``torch.backends.xeon.run_cpu`` bind CPU
training the same way.

The CPUs the launcher may run on (its affinity) are split into one run per task, in task
order, by whole physical cores where there are enough (a core's hardware threads never go to
two tasks then); each task's process starts with its run as its affinity, and every
thread and process it starts inherits it (a data loader's workers too: give a task
several CPUs, or do not bind, where they should run beside it). Off by default: two jobs
bound on one machine would each take the same CPUs (task 0 of each the first).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TypeVar

__all__ = ["plan_cores", "describe_plan", "started_on"]

_Key = TypeVar("_Key")


def plan_cores(tasks: Sequence[_Key], cpus: Sequence[int] | None = None,
               topology: Callable[[int], tuple[int, frozenset[int]]] | None = None) -> dict[_Key, tuple[int, ...]]:
    """Each task's CPUs: ``cpus`` (default: this process's affinity) split into one run per task,
    in task order, by whole physical cores where there are as many as tasks.

    The CPUs are ordered by socket, then core, a core's hardware threads side by side (Linux
    numbers a core's second thread far from its first: CPUs 0 and 16 may be one core), so a task
    never shares a core with another task while each can have cores of its own, and stays on
    one socket while its share fits there. Where the shares do not divide, the first tasks get
    one core (or CPU) more.

    Args:
        tasks: the tasks of this host, in order.
        cpus: the CPUs to split (default: this process's affinity).
        topology: a CPU's (socket, CPUs of its core); default: read from
            ``/sys/devices/system/cpu`` (each CPU its own core where that cannot be read).

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
    cores = _physical_cores(usable, topology or _sysfs_topology)
    if len(tasks) <= len(cores):  # whole cores: no two tasks on one core's threads
        return dict(zip(tasks, (tuple(sorted(c for core in run for c in core)) for run in _split(cores, len(tasks)))))
    in_order = [c for core in cores for c in core]  # threads of one core side by side
    return dict(zip(tasks, (tuple(sorted(run)) for run in _split(in_order, len(tasks)))))


_T = TypeVar("_T")


def _split(items: Sequence[_T], parts: int) -> list[Sequence[_T]]:
    """``items`` in ``parts`` contiguous runs, the first ones one longer where they do not divide."""
    share, extra = divmod(len(items), parts) if parts else (0, 0)
    runs, start = [], 0
    for position in range(parts):
        size = share + (1 if position < extra else 0)
        runs.append(items[start:start + size])
        start += size
    return runs


def _physical_cores(cpus: Sequence[int],
                    topology: Callable[[int], tuple[int, frozenset[int]]]) -> list[tuple[int, ...]]:
    """The usable CPUs grouped by physical core, cores ordered by socket, then by their first CPU."""
    cores: dict[tuple[int, frozenset[int]], list[int]] = {}
    for cpu in cpus:
        socket_id, siblings = topology(cpu)
        cores.setdefault((socket_id, siblings | {cpu}), []).append(cpu)
    return [tuple(sorted(members)) for _, members in sorted(cores.items(), key=lambda kv: (kv[0][0], min(kv[1])))]


def _sysfs_topology(cpu: int) -> tuple[int, frozenset[int]]:
    """CPU ``cpu``'s socket and the CPUs of its core, from sysfs; (0, {cpu}) where unreadable."""
    base = f"/sys/devices/system/cpu/cpu{cpu}/topology"
    try:
        with open(f"{base}/physical_package_id") as f:
            socket_id = int(f.read())
        siblings = _read_cpu_list(f"{base}/core_cpus_list", f"{base}/thread_siblings_list")
    except (OSError, ValueError):
        return 0, frozenset({cpu})
    return socket_id, siblings


def _read_cpu_list(*paths: str) -> frozenset[int]:
    """The first readable of ``paths`` as a CPU list (``"0,16"``, ``"0-3"``)."""
    for path in paths:
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        found: set[int] = set()
        for part in filter(None, text.split(",")):
            lo, _, hi = part.partition("-")
            found.update(range(int(lo), int(hi or lo) + 1))
        return frozenset(found)
    raise OSError(f"none of {paths} could be read")


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
