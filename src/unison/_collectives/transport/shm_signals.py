"""Counters in shared memory that the workers of one host synchronise on, instead of gloo.

The shared-memory all-reduce needs only to know when every worker of the host has
written its slot, and when every worker has summed its slice. A one-element gloo
all-reduce per such point is a loopback TCP round trip (two of them per training step
were most of a tiny step's time: ``benchmarks/RESULTS.md``, 'Shared-memory counters
instead of gloo'); a counter per worker in the shared file costs a store and a few loads.

Each worker owns three cache lines of the signal file: its pid and start time (so peers
can tell when it died), one monotonically increasing counter per kind of event, the
signatures of its checked calls (``same_signature``: the per-call check of a reduce, compared
here instead of in a gloo all-gather), and whether it sleeps in the kernel. A
worker *posts* an event by storing its next count (only it writes its line), and
*waits* until every worker's count of that kind has reached its own. Ordering: the
store of a count comes after the data writes it announces (an opaque library call
apart, so the compiler keeps the order); x86-64 keeps stores in order and loads in
order, so a peer that sees the count sees the data. Other architectures reorder
stores, and Python has no memory fence: :func:`supported` is False there and the
workers keep the gloo synchronisation.

A wait polls first (``SpinPolicy`` says how long); past that it sleeps in the kernel on
the late peer's counter (a shared ``futex``), and a post wakes whoever sleeps on the
poster's counter: the sleeper costs no CPU and wakes as soon as the peer posts, where a
timed sleep either wakes often for nothing or overshoots the peer's arrival. A post makes
the wake's system call (3 us) only where a peer has said it sleeps: most waits end within
their poll, and a tiny step posts several times. The sleeper stores that word before its
``FUTEX_WAIT`` (whose kernel path takes a lock, a full fence, before it reads the counter);
the poster stores its count, fences (a lock's acquire and release: locked instructions on
x86-64), then reads the words. Whichever order the two run in, either the poster sees the
sleeper's word and wakes it, or the sleeper's kernel sees the new count and does not sleep.

A peer that dies is noticed within ``_LIVENESS_PERIOD_S`` through ``/proc`` (its pid
gone, a zombie, or another process with its pid), and a peer that stops posting
without dying is bounded by the group's timeout, as a gloo collective would be.
"""

from __future__ import annotations

import collections
import ctypes
import enum
import math
import os
import platform
import threading
import time
import typing
from collections.abc import Callable, Sequence

import torch

from unison._cluster.threads import usable_cpus

__all__ = ["SharedSignals", "SpinPolicy", "Futex", "Slept", "kernel_futex", "make_signals", "supported",
           "runnable_tasks", "parse_runnable", "WRITTEN", "ARRIVED", "SLOTS_PER_WORKER", "SIGNATURE_WORDS"]

SLOTS_PER_WORKER = 24
"""int64 words per worker: three 64-byte cache lines, so workers never write each other's lines."""
_PID, _START = 0, 1
WRITTEN = 2
"""Counts 'my input slot of the next gradient bucket is written'."""
ARRIVED = 3
"""Counts barriers: 'I am here' (e.g. my slice of every result is summed)."""
_SIGNATURES = 4
"""The words of a worker's line from which its call signatures lie: two buffers, used by turns."""
SIGNATURE_WORDS = 6
"""The most ints a call signature may have (``same_signature``)."""
_ASLEEP = _SIGNATURES + 2 * SIGNATURE_WORDS
"""The word of a worker's line that is 1 while it sleeps in ``Futex.wait`` (else 0): a post wakes only then."""
SPIN_FLOOR_S = 50e-6
"""Every wait polls this long before anything else: a peer close behind arrives within microseconds."""
SPIN_CAP_S = 0.01
"""The longest a wait polls, where it takes no core anyone needs: a sleep overshoots the peer's arrival
by up to the sleep (plus the kernel's timer slack), which a step that waits for a slower peer pays
every time. Bounded, since other processes (data loaders) may want the core after all."""
SPIN_SHARED_S = 0.002
"""The longest a wait polls where its core may be wanted (more workers than CPUs, or more runnable
tasks than CPUs): long enough for a peer a few hundred microseconds behind, short enough to hand the
core back soon to a peer that was descheduled."""
LOAD_PERIOD_S = 0.02
"""How often, at most, a wait reads how many tasks the machine has runnable (``/proc/loadavg``: 10-25 us)."""
BUSY_HOLD_S = 0.5
"""How long one sight of more runnable tasks than CPUs keeps the waits from polling past the floor."""
_RECENT_WAITS = 8
_MAX_SLEEP_S = 0.0002
_LIVENESS_PERIOD_S = 0.05
_SYS_FUTEX = 202  # x86-64's syscall number, the only platform the counters are used on (supported())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # not FUTEX_PRIVATE_FLAG: the words live in a file several processes map
_EINTR, _EAGAIN, _ETIMEDOUT = 4, 11, 110


def supported() -> bool:
    """Whether shared-memory counters are safe here: Linux on x86-64 (ordered stores, ``/proc``)."""
    return platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir("/proc/self")


class Slept(enum.Enum):
    """How a :meth:`Futex.wait` ended."""

    WOKEN = "woken"  # someone woke the sleepers on the word
    TIMED_OUT = "timed out"
    CHANGED = "changed"  # the word no longer held what the sleeper read, or a signal came
    FAILED = "failed"  # the kernel refused the call: sleep some other way


class _Timespec(ctypes.Structure):
    """C's ``struct timespec``: the longest a ``FUTEX_WAIT`` sleeps."""

    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


@typing.final
class Futex:
    """Sleeping on a word of shared memory until someone changes it, and waking such sleepers
    (Linux's ``futex`` on x86-64, through libc's ``syscall``; the GIL is released meanwhile).

    The low 32 bits of an int64 counter are its first four bytes there: a sleeper passes the
    counter's value as it read it, and the kernel puts it to sleep only if those bits still
    hold it, so a post between the read and the sleep is never missed.
    """

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self._syscall = libc.syscall
        self._syscall.restype = ctypes.c_long
        self._syscall.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                                  ctypes.c_void_p, ctypes.c_uint32]

    def wait(self, address: int, seen: int, seconds: float) -> Slept:
        """Sleeps while the word at ``address`` holds ``seen`` (its low 32 bits), at most ``seconds``;
        returns how the sleep ended."""
        whole = int(seconds)
        timeout = _Timespec(whole, int((seconds - whole) * 1e9))
        done = self._syscall(_SYS_FUTEX, address, _FUTEX_WAIT, seen & 0xFFFFFFFF, ctypes.byref(timeout), None, 0)
        if done == 0:
            return Slept.WOKEN
        error = ctypes.get_errno()
        if error == _ETIMEDOUT:
            return Slept.TIMED_OUT
        return Slept.CHANGED if error in (_EAGAIN, _EINTR) else Slept.FAILED

    def wake(self, address: int) -> None:
        """Wakes every sleeper on the word at ``address`` (none: a system call that returns at once)."""
        self._syscall(_SYS_FUTEX, address, _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)


def kernel_futex() -> Futex | None:
    """A :class:`Futex` where the counters are used (``supported()``) and libc has ``syscall``; else None."""
    if not supported():
        return None
    try:
        return Futex()
    except (OSError, AttributeError):
        return None


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks (``/proc/<pid>/stat`` field 22), or None if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            text = stat.read()
    except OSError:
        return None
    fields = text[text.rfind(b")") + 2:].split()  # after the command name, which may hold spaces
    if not fields or fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def runnable_tasks() -> int | None:
    """Tasks the kernel has runnable right now, on the whole machine (``/proc/loadavg``), or None off Linux."""
    try:
        with open("/proc/loadavg", "rb") as loadavg:
            return parse_runnable(loadavg.read())
    except (OSError, ValueError):
        return None


def parse_runnable(text: bytes) -> int:
    """The runnable tasks in ``/proc/loadavg``'s text: its fourth field is ``runnable/all``.

    Raises:
        ValueError: if the text does not have that form.
    """
    fields = text.split()
    if len(fields) < 4 or b"/" not in fields[3]:
        raise ValueError(f"not /proc/loadavg's form: {text!r}")
    return int(fields[3].split(b"/")[0])


@typing.final
class SpinPolicy:
    """How long a shared-memory wait polls before it sleeps: only while polling costs no one a core
    and the peer is expected soon.

    A polling worker holds a core. That is free where every worker of the host has a core
    and nothing else wants one, and it answers a peer's arrival within microseconds,
    where a sleep overshoots it. Elsewhere it takes the core the peer (or its gloo
    threads, a data loader, another job) needs to arrive at all (two simulated hosts of
    two workers on two cores: ``benchmarks/RESULTS.md``, 'Waits that poll only where a
    core is free'). So a wait polls up to ``SPIN_CAP_S`` only where

    - the host's workers have a CPU each in this process's affinity, and
    - the machine has not had more runnable tasks than CPUs at two readings in a row for
      ``BUSY_HOLD_S`` (read from ``/proc/loadavg`` at most every ``LOAD_PERIOD_S``; polling
      workers count as runnable, so workers that crowd their cores see each other);

    elsewhere up to ``SPIN_SHARED_S``. Either limit holds only while the peer is expected
    soon: when the recent waits of the same kind mostly lasted longer than half the limit,
    a wait polls ``SPIN_FLOOR_S`` (a peer that far away is slept for, not polled for).
    Past its poll, a wait sleeps until the peer posts (``Futex``; without one, timed sleeps
    doubling up to 0.2 ms).

    Args:
        workers: the workers of the host that wait on each other.
        cpus: CPUs this process may run on (default: its affinity).
        machine_cpus: CPUs of the machine, to which the runnable count is compared (default: ``os.cpu_count()``).
        runnable: reads the machine's runnable tasks now, or None when it cannot.
    """

    def __init__(self, workers: int, cpus: int | None = None, machine_cpus: int | None = None,
                 runnable: Callable[[], int | None] = runnable_tasks):
        self._core_each = workers <= (usable_cpus() if cpus is None else cpus)
        self._machine_cpus = machine_cpus if machine_cpus is not None else (os.cpu_count() or 1)
        self._runnable = runnable
        self._sampled_at = -math.inf
        self._busy_until = -math.inf
        self._crowded_before = False  # the last reading's verdict
        self._recent: dict[int, collections.deque[float]] = {}

    def budget(self, kind: int, now: float) -> float:
        """Seconds a wait of ``kind`` polls before it sleeps, asked once it has polled ``SPIN_FLOOR_S``.

        Args:
            kind: the kind of event waited for (``WRITTEN``, ``ARRIVED``).
            now: ``time.monotonic()``.
        """
        limit = SPIN_CAP_S if self._core_each and not self._crowded(now) else SPIN_SHARED_S
        recent = self._recent.get(kind)
        if recent and sorted(recent)[len(recent) // 2] > limit / 2:
            return SPIN_FLOOR_S
        return limit

    def record(self, kind: int, waited: float) -> None:
        """Notes how long a wait of ``kind`` that did not end at once took, in seconds."""
        recent = self._recent.get(kind)
        if recent is None:
            recent = self._recent[kind] = collections.deque(maxlen=_RECENT_WAITS)
        recent.append(waited)

    def _crowded(self, now: float) -> bool:
        """Whether the machine had more runnable tasks than CPUs at two readings in a row, within the last
        ``BUSY_HOLD_S``.

        Two in a row: one task woken for a moment beside a host's polling workers (the
        launcher, a kernel thread, the benchmark's parent) makes one reading crowded, and
        stopping the long polls for the hold on that cost MWMS on the D workload 9% of its
        speed against DDP; workers that crowd their cores (two simulated hosts on two
        cores) are runnable at every reading.
        """
        if now - self._sampled_at >= LOAD_PERIOD_S:
            self._sampled_at = now
            runnable = self._runnable()
            crowded = runnable is not None and runnable > self._machine_cpus
            if crowded and self._crowded_before:
                self._busy_until = now + BUSY_HOLD_S
            self._crowded_before = crowded
        return now < self._busy_until


@typing.final
class SharedSignals:
    """One host's workers' event counters in a shared int64 tensor.

    Every worker must post the same events in the same order (as for collectives).

    Args:
        words: ``world_size * SLOTS_PER_WORKER`` shared int64 elements, zeroed, mapped
            by every worker of the host (kept alive here).
        rank, world_size: this worker's place among them.
        timeout: seconds a wait may last before it fails.
        names: the workers' task names by rank, for error messages.
        policy: how long a wait polls before it sleeps (default: a :class:`SpinPolicy` for ``world_size`` workers).
        futex: what a wait sleeps in past its poll, and what a post wakes (``make_signals``
            gives the kernel's, ``kernel_futex``); None: timed sleeps, doubling up to 0.2 ms.

    Call :meth:`introduce` on every worker, then a barrier, then :meth:`watch_peers`.
    """

    def __init__(self, words: torch.Tensor, rank: int, world_size: int, timeout: float, names: list[str],
                 policy: SpinPolicy | None = None, futex: Futex | None = None):
        if words.dtype != torch.int64 or words.numel() < world_size * SLOTS_PER_WORKER:
            raise ValueError(f"signal words must be >= {world_size * SLOTS_PER_WORKER} int64, got {words.dtype} "
                             f"x {words.numel()}")
        self._words = words  # keeps the mapping alive
        self._cells = (ctypes.c_int64 * words.numel()).from_address(words.data_ptr())
        self._rank, self._world_size = rank, world_size
        self._timeout = timeout
        self._names = names
        self._counts = [0] * SLOTS_PER_WORKER
        self._policy = policy if policy is not None else SpinPolicy(world_size)
        self._futex = futex
        self._fence = threading.Lock()  # acquired and released: a full memory fence (see the module's docstring)
        self._asleep_words = [r * SLOTS_PER_WORKER + _ASLEEP for r in range(world_size) if r != rank]
        self._address = words.data_ptr()
        self._watched: dict[int, tuple[int, int]] = {}  # rank -> (pid, start time) of peers /proc can see

    def introduce(self) -> None:
        """Writes this worker's pid and start time into its line."""
        pid = os.getpid()
        base = self._rank * SLOTS_PER_WORKER
        self._cells[base + _START] = _start_time(pid) or 0
        self._cells[base + _PID] = pid

    def watch_peers(self) -> None:
        """Notes which peers this worker can watch through ``/proc`` (after every worker introduced itself).

        A peer in another pid namespace (a container sharing ``/dev/shm``) shows another
        process or none under its pid; such a peer is not watched, and only the timeout
        bounds a wait for it.
        """
        for rank in range(self._world_size):
            if rank == self._rank:
                continue
            base = rank * SLOTS_PER_WORKER
            pid, start = self._cells[base + _PID], self._cells[base + _START]
            if pid > 0 and start > 0 and _start_time(pid) == start:
                self._watched[rank] = (pid, start)

    def post(self, kind: int) -> int:
        """Counts one event of ``kind`` for this worker; returns the count every worker must reach."""
        self._counts[kind] += 1
        count = self._counts[kind]
        cell = self._rank * SLOTS_PER_WORKER + kind
        cells = self._cells
        cells[cell] = count
        if self._futex is not None:
            with self._fence:  # the count is visible to every core before the peers' words are read
                pass
            if any(cells[word] for word in self._asleep_words):  # a peer sleeps, maybe on this counter
                self._futex.wake(self._address + 8 * cell)
        return count

    def reached(self, kind: int, count: int) -> bool:
        """Whether every worker has posted ``count`` events of ``kind``."""
        cells = self._cells
        return all(cells[r * SLOTS_PER_WORKER + kind] >= count for r in range(self._world_size))

    def wait(self, kind: int, count: int, timeout: float | None = None) -> None:
        """Waits until every worker has posted ``count`` events of ``kind``.

        Raises:
            RuntimeError: naming the workers that died, or that did not post within the timeout.
        """
        if self.reached(kind, count):
            return
        start = time.monotonic()
        deadline = start + (self._timeout if timeout is None else timeout)
        next_check = start + _LIVENESS_PERIOD_S
        budget: float | None = None  # asked of the policy once the floor has passed
        sleep = 0.0
        while not self.reached(kind, count):
            now = time.monotonic()
            if now >= next_check:
                self._raise_if_dead(kind, count)
                if now >= deadline:
                    late = self._late(kind, count)
                    raise RuntimeError(f"shared-memory wait timed out after {now - start:.1f} s: "
                                       f"{', '.join(late)} did not arrive")
                next_check = now + _LIVENESS_PERIOD_S
            waited = now - start
            if budget is None and waited >= SPIN_FLOOR_S:
                budget = self._policy.budget(kind, now)
            if budget is None or waited < budget:
                os.sched_yield()
            elif self._futex is not None:  # until the late peer posts, or the next look at its liveness
                if self._sleep_on_late_peer(kind, count, max(min(next_check, deadline) - now, 1e-4)) is Slept.FAILED:
                    self._futex = None  # the kernel refused it (it would fail at once every time): timed sleeps
            else:
                sleep = min(_MAX_SLEEP_S, sleep * 2 or 1e-5)
                time.sleep(sleep)
        self._policy.record(kind, time.monotonic() - start)

    def _sleep_on_late_peer(self, kind: int, count: int, seconds: float) -> Slept | None:
        """Sleeps on the first peer's counter of ``kind`` still below ``count`` until it changes
        (``Futex.wait``'s answer; None: none was below any more)."""
        cells = self._cells
        for rank in range(self._world_size):
            cell = rank * SLOTS_PER_WORKER + kind
            seen = cells[cell]
            if seen < count:
                assert self._futex is not None
                asleep = self._rank * SLOTS_PER_WORKER + _ASLEEP
                cells[asleep] = 1  # before the kernel reads the counter: a post from now on wakes this worker
                try:
                    return self._futex.wait(self._address + 8 * cell, seen, seconds)
                finally:
                    cells[asleep] = 0
        return None

    def barrier(self, timeout: float | None = None) -> None:
        """Every worker of the host arrives (one post and one wait of ``ARRIVED``)."""
        self.wait(ARRIVED, self.post(ARRIVED), timeout)

    def same_signature(self, signature: Sequence[int], turn: int) -> bool:
        """Whether every worker of the host comes with this ``signature`` (non-negative ints below
        2**63, at most ``SIGNATURE_WORDS``): each writes its own into buffer ``turn % 2`` of its
        line, all meet at a barrier, and each compares every worker's. Every worker reaches the
        same answer, and the barrier is one as any other.

        Callers alternate ``turn`` call by call (``WorkerControl.check_call``'s sequence number):
        a worker that goes on to its next call writes the other buffer, and the one after that
        waits at its barrier for the slowest worker, which has read this one by then.
        """
        if len(signature) > SIGNATURE_WORDS:
            raise ValueError(f"a call signature holds at most {SIGNATURE_WORDS} ints, got {len(signature)}")
        cells, start = self._cells, _SIGNATURES + (turn % 2) * SIGNATURE_WORDS
        mine = self._rank * SLOTS_PER_WORKER + start
        for i, value in enumerate(signature):
            cells[mine + i] = value
        self.barrier()
        return all(cells[rank * SLOTS_PER_WORKER + start + i] == value
                   for rank in range(self._world_size) for i, value in enumerate(signature))

    def _late(self, kind: int, count: int) -> list[str]:
        return [self._names[r] for r in range(self._world_size)
                if self._cells[r * SLOTS_PER_WORKER + kind] < count]

    def _raise_if_dead(self, kind: int, count: int) -> None:
        for rank, (pid, start) in self._watched.items():
            if self._cells[rank * SLOTS_PER_WORKER + kind] < count and _start_time(pid) != start:
                raise RuntimeError(f"{self._names[rank]} (pid {pid}) exited while this worker waited for it in "
                                   f"shared memory")


def make_signals(words: torch.Tensor, rank: int, world_size: int, timeout: float, names: list[str],
                 barrier: Callable[[], None]) -> SharedSignals:
    """Signals over ``words`` on every worker (a collective: ``barrier`` must be the host's)."""
    signals = SharedSignals(words, rank, world_size, timeout, names, futex=kernel_futex())
    signals.introduce()
    barrier()
    signals.watch_peers()
    return signals
