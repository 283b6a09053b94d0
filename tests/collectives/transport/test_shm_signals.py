"""Shared-memory counters: posting, waiting, and naming a peer that died or is late."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from unison._collectives.transport import shm_signals
from unison._collectives.transport.shm_signals import ARRIVED, SLOTS_PER_WORKER, WRITTEN, SharedSignals, Slept

pytestmark = pytest.mark.skipif(not shm_signals.supported(), reason="shared counters need Linux on x86-64")

NAMES = ["worker:0", "worker:1"]


def _pair(timeout: float = 5.0) -> tuple[SharedSignals, SharedSignals]:
    """Both workers' views of one zeroed block (in one process: the same memory either way)."""
    words = torch.zeros(2 * SLOTS_PER_WORKER, dtype=torch.int64)
    first, second = (SharedSignals(words, rank, 2, timeout, NAMES) for rank in range(2))
    for signals in (first, second):
        signals.introduce()
    for signals in (first, second):
        signals.watch_peers()
    return first, second


def test_a_wait_returns_once_every_worker_posted():
    first, second = _pair()
    count = first.post(WRITTEN)
    assert count == 1 and not first.reached(WRITTEN, count)
    thread = threading.Thread(target=lambda: (time.sleep(0.05), second.post(WRITTEN)))
    thread.start()
    first.wait(WRITTEN, count)
    thread.join()
    assert first.reached(WRITTEN, 1) and second.reached(WRITTEN, 1)
    assert not first.reached(ARRIVED, 1)  # the kinds count apart


def test_barriers_pair_up_in_order():
    first, second = _pair()
    done = []
    thread = threading.Thread(target=lambda: [second.barrier() or done.append(i) for i in range(50)])
    thread.start()
    for _ in range(50):
        first.barrier()
    thread.join(5)
    assert done == list(range(50))


def _both(first: SharedSignals, second: SharedSignals, mine: list[int], theirs: list[int],
          turn: int) -> tuple[bool, bool]:
    """Each worker's answer to ``same_signature``, the second worker in a thread."""
    answers: dict[int, bool] = {}
    thread = threading.Thread(target=lambda: answers.update(second=second.same_signature(theirs, turn)))
    thread.start()
    answers["first"] = first.same_signature(mine, turn)
    thread.join(5)
    return answers["first"], answers["second"]


def test_call_signatures_agree_on_every_worker_call_after_call():
    first, second = _pair()
    call = [2, 0xFFFFFFFF, 7, 1, 123456789]  # the check's five ints: a CRC may use all 32 bits
    for turn in range(1, 7):  # the buffers alternate; a stale one from two calls back never answers
        call[3] = turn
        assert _both(first, second, call, list(call), turn) == (True, True)
    differing = [dict(enumerate(call)) | {i: call[i] + 1} for i in range(len(call))]
    for turn, theirs in enumerate(differing, start=7):
        assert _both(first, second, call, [theirs[i] for i in range(len(call))], turn) == (False, False)
    with pytest.raises(ValueError, match="at most 6 ints"):
        first.same_signature([0] * 7, 1)


def test_a_late_worker_is_named_when_the_timeout_passes():
    first, _ = _pair()
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"timed out after .* worker:1 did not arrive"):
        first.wait(WRITTEN, first.post(WRITTEN), timeout=0.3)
    assert 0.3 <= time.monotonic() - started < 2.0


def test_a_dead_worker_is_named_long_before_the_timeout():
    words = torch.zeros(2 * SLOTS_PER_WORKER, dtype=torch.int64)
    mine = SharedSignals(words, 0, 2, 60.0, NAMES)
    mine.introduce()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        words[SLOTS_PER_WORKER + 1] = shm_signals._start_time(child.pid)  # what the peer would introduce
        words[SLOTS_PER_WORKER] = child.pid
        mine.watch_peers()
        threading.Timer(0.2, child.kill).start()
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=rf"worker:1 \(pid {child.pid}\) exited"):
            mine.wait(WRITTEN, mine.post(WRITTEN))
        assert time.monotonic() - started < 5.0
    finally:
        child.kill()
        child.wait()


def test_a_peer_that_proc_cannot_confirm_is_not_watched():
    """A pid /proc shows with another start time (another pid namespace) is not taken for dead."""
    words = torch.zeros(2 * SLOTS_PER_WORKER, dtype=torch.int64)
    mine = SharedSignals(words, 0, 2, 60.0, NAMES)
    mine.introduce()
    words[SLOTS_PER_WORKER] = os.getpid()
    words[SLOTS_PER_WORKER + 1] = 12345  # not this process's start time
    mine.watch_peers()
    assert mine._watched == {}


def test_start_time_of_a_gone_process_is_none():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert shm_signals._start_time(child.pid) is None
    assert shm_signals._start_time(os.getpid()) > 0


def test_too_few_words_are_refused():
    with pytest.raises(ValueError, match="signal words"):
        SharedSignals(torch.zeros(3, dtype=torch.int64), 0, 2, 1.0, NAMES)


# -- how long a wait polls: the policy's decisions, on a fake clock and a fake load ------
class _Load:
    """A settable runnable-task count that counts how often it was read."""

    def __init__(self, runnable: int | None):
        self.runnable, self.reads = runnable, 0

    def __call__(self) -> int | None:
        self.reads += 1
        return self.runnable


def _policy(load: _Load, workers: int = 2, cpus: int = 2) -> shm_signals.SpinPolicy:
    return shm_signals.SpinPolicy(workers, cpus=cpus, machine_cpus=cpus, runnable=load)


def test_a_wait_polls_long_where_every_worker_has_a_core_and_nothing_else_runs():
    policy = _policy(_Load(2))
    assert policy.budget(WRITTEN, now=100.0) == shm_signals.SPIN_CAP_S


def test_more_workers_than_cpus_poll_briefly():
    load = _Load(1)
    assert _policy(load, workers=3, cpus=2).budget(WRITTEN, now=100.0) == shm_signals.SPIN_SHARED_S


def _crowd(policy: shm_signals.SpinPolicy, load: _Load, now: float, runnable: int = 4) -> float:
    """Two crowded readings in a row, ending at ``now``; returns ``now``."""
    load.runnable = runnable
    policy.budget(WRITTEN, now=now - 1.5 * shm_signals.LOAD_PERIOD_S)
    policy.budget(WRITTEN, now=now)
    return now


def test_more_runnable_tasks_than_cpus_stop_the_long_polls_for_the_hold():
    # Two hosts' workers on the same two cores: the affinity says 'a core each', the load does not.
    load = _Load(4)
    policy = _policy(load)
    start = _crowd(policy, load, 100.0)
    assert policy.budget(WRITTEN, now=start) == shm_signals.SPIN_SHARED_S
    load.runnable = 2  # a quiet moment does not end the hold at once ...
    later = start + 1.5 * shm_signals.LOAD_PERIOD_S
    assert policy.budget(WRITTEN, now=later) == shm_signals.SPIN_SHARED_S
    # ... a hold without another crowded sighting does
    assert policy.budget(WRITTEN, now=start + shm_signals.BUSY_HOLD_S + 1.5 * shm_signals.LOAD_PERIOD_S) == \
        shm_signals.SPIN_CAP_S


def test_one_crowded_reading_alone_keeps_the_long_poll():
    # A task woken for a moment beside a host's polling workers: one reading over the CPUs, the next not.
    load = _Load(3)
    policy = _policy(load)
    assert policy.budget(WRITTEN, now=100.0) == shm_signals.SPIN_CAP_S
    load.runnable = 2
    assert policy.budget(WRITTEN, now=100.0 + 1.5 * shm_signals.LOAD_PERIOD_S) == shm_signals.SPIN_CAP_S
    load.runnable = 3  # crowded again, but not twice in a row
    assert policy.budget(WRITTEN, now=100.0 + 3 * shm_signals.LOAD_PERIOD_S) == shm_signals.SPIN_CAP_S
    # a second crowded reading in a row is crowding
    assert policy.budget(WRITTEN, now=100.0 + 4.5 * shm_signals.LOAD_PERIOD_S) == shm_signals.SPIN_SHARED_S


def test_the_load_is_read_at_most_once_per_period():
    load = _Load(2)
    policy = _policy(load)
    for step in range(10):
        policy.budget(WRITTEN, now=100.0 + step * shm_signals.LOAD_PERIOD_S / 10)
    assert load.reads == 1
    policy.budget(ARRIVED, now=100.0 + 1.5 * shm_signals.LOAD_PERIOD_S)
    assert load.reads == 2


def test_no_load_reading_falls_back_to_the_affinity():
    assert _policy(_Load(None)).budget(WRITTEN, now=100.0) == shm_signals.SPIN_CAP_S
    assert _policy(_Load(None), workers=4).budget(WRITTEN, now=100.0) == shm_signals.SPIN_SHARED_S


def test_a_peer_usually_further_away_than_the_poll_reaches_is_slept_for_per_kind():
    policy = _policy(_Load(2))
    for _ in range(5):
        policy.record(ARRIVED, shm_signals.SPIN_CAP_S)  # longer than half the cap
    for _ in range(5):
        policy.record(WRITTEN, 0.0001)
    assert policy.budget(ARRIVED, now=100.0) == shm_signals.SPIN_FLOOR_S
    assert policy.budget(WRITTEN, now=100.0) == shm_signals.SPIN_CAP_S  # the other kind is close
    for _ in range(5):  # the peer comes close again: the recent waits win back the long poll
        policy.record(ARRIVED, 0.0001)
    assert policy.budget(ARRIVED, now=100.0) == shm_signals.SPIN_CAP_S


def test_on_a_crowded_machine_a_peer_further_than_the_short_poll_reaches_is_slept_for():
    # 1.5 ms is close for a free core's 10 ms poll, far for the 2 ms poll of a crowded machine.
    between = 1.5e-3
    assert shm_signals.SPIN_SHARED_S / 2 < between < shm_signals.SPIN_CAP_S / 2
    load = _Load(2)
    policy = _policy(load)
    for _ in range(5):
        policy.record(WRITTEN, between)
    assert policy.budget(WRITTEN, now=100.0) == shm_signals.SPIN_CAP_S
    _crowd(policy, load, 101.0, runnable=5)
    assert policy.budget(WRITTEN, now=101.0) == shm_signals.SPIN_FLOOR_S
    for _ in range(5):  # waits of a few microseconds again: the short poll comes back
        policy.record(WRITTEN, 20e-6)
    assert policy.budget(WRITTEN, now=101.0 + 1.5 * shm_signals.LOAD_PERIOD_S) == shm_signals.SPIN_SHARED_S


def test_loadavg_text_gives_the_runnable_count():
    assert shm_signals.parse_runnable(b"3.96 2.52 2.27 8/174 310\n") == 8
    with pytest.raises(ValueError, match="loadavg"):
        shm_signals.parse_runnable(b"3.96 2.52")
    assert shm_signals.runnable_tasks() >= 1  # this test runs


def test_waits_ask_the_policy_after_the_floor_and_report_how_long_they_took():
    asked, recorded = [], []
    waiting = threading.Event()

    class Policy:
        def budget(self, kind, now):
            asked.append(kind)
            waiting.set()  # the wait is past its floor: now the peer may arrive
            return 0.0  # sleep at once

        def record(self, kind, waited):
            recorded.append((kind, waited))

    words = torch.zeros(2 * SLOTS_PER_WORKER, dtype=torch.int64)
    first = SharedSignals(words, 0, 2, 5.0, NAMES, policy=Policy())
    second = SharedSignals(words, 1, 2, 5.0, NAMES)
    second.post(WRITTEN)
    first.wait(WRITTEN, first.post(WRITTEN))  # the peer is there: no polling, nothing to learn
    assert asked == [] and recorded == []
    thread = threading.Thread(target=lambda: (waiting.wait(5), second.post(ARRIVED)))
    thread.start()
    first.wait(ARRIVED, first.post(ARRIVED))
    thread.join()
    assert asked == [ARRIVED]  # once per wait, not once per poll
    assert [kind for kind, _ in recorded] == [ARRIVED] and recorded[0][1] >= shm_signals.SPIN_FLOOR_S


class _SleepAtOnce:
    """A wait policy that polls no longer than the floor: every wait past it sleeps."""

    def budget(self, kind, now):
        return 0.0

    def record(self, kind, waited):
        pass


def test_a_futex_sleeper_is_woken_by_a_change_and_not_put_to_sleep_on_a_stale_value():
    futex = shm_signals.kernel_futex()
    assert futex is not None  # x86-64 Linux: the counters' platform
    word = torch.zeros(1, dtype=torch.int64)
    address = word.data_ptr()
    assert futex.wait(address, 7, 5.0) is Slept.CHANGED  # the word no longer holds what the sleeper read
    assert futex.wait(address, 0, 0.01) is Slept.TIMED_OUT  # nobody changed it

    def change_and_wake():
        time.sleep(0.05)
        word[0] = 1
        futex.wake(address)

    thread = threading.Thread(target=change_and_wake)
    thread.start()
    answer = futex.wait(address, 0, 5.0)  # without the wake: 5 s, then "timed out"
    thread.join()
    assert answer in (Slept.WOKEN, Slept.CHANGED)  # "changed": the thread ran before the sleep began


_CHILD_WAKES = """
import ctypes, mmap, sys, time
# unison's wake, without importing unison (torch takes seconds to import): the system call
# and the operation are the parent's module's, passed on the command line
syscall_number, wake = int(sys.argv[2]), int(sys.argv[3])
with open(sys.argv[1], "r+b") as f:
    mm = mmap.mmap(f.fileno(), 8)
word = ctypes.c_int64.from_buffer(mm)
time.sleep(0.1)
word.value = 1
ctypes.CDLL(None).syscall(syscall_number, ctypes.c_void_p(ctypes.addressof(word)), wake, 0x7FFFFFFF, None, None, 0)
"""


def test_a_futex_sleeper_is_woken_from_another_process_through_a_shared_file(tmp_path):
    """The counters live in a file every worker maps: a post in one process must wake a sleeper
    in another (a shared futex, keyed by the file, not by an address of one process)."""
    import ctypes
    import mmap

    path = tmp_path / "word"
    path.write_bytes(bytes(8))
    with open(path, "r+b") as f:
        mm = mmap.mmap(f.fileno(), 8)
    word = ctypes.c_int64.from_buffer(mm)
    child = subprocess.Popen([sys.executable, "-c", _CHILD_WAKES, str(path), str(shm_signals._SYS_FUTEX),
                              str(shm_signals._FUTEX_WAKE)])
    try:
        futex = shm_signals.kernel_futex()
        assert futex is not None
        answer = futex.wait(ctypes.addressof(word), 0, 20.0)  # not woken across processes: 20 s, "timed out"
        assert answer in (Slept.WOKEN, Slept.CHANGED) and word.value == 1
    finally:
        child.wait(30)
        del word
        mm.close()


def test_a_wait_past_its_poll_sleeps_until_the_peer_posts_and_a_post_wakes_it():
    """Past the poll the wait sleeps in the kernel on the late peer's counter: woken by the
    peer's post, not by a timeout (each sleep lasts until the next look at the peers' liveness)."""
    kernel = shm_signals.kernel_futex()
    assert kernel is not None
    answers: list[Slept] = []
    woken: list[int] = []
    asleep = threading.Event()

    class Recording:
        def wait(self, address, seen, seconds):
            asleep.set()
            answers.append(kernel.wait(address, seen, seconds))
            return answers[-1]

        def wake(self, address):
            woken.append(address)
            kernel.wake(address)

    words = torch.zeros(2 * SLOTS_PER_WORKER, dtype=torch.int64)
    first = SharedSignals(words, 0, 2, 5.0, NAMES, policy=_SleepAtOnce(), futex=Recording())
    second = SharedSignals(words, 1, 2, 5.0, NAMES, futex=Recording())
    thread = threading.Thread(target=lambda: (asleep.wait(5), time.sleep(0.01), second.post(WRITTEN)))
    thread.start()
    first.wait(WRITTEN, first.post(WRITTEN))
    thread.join()
    assert first.reached(WRITTEN, 1)
    assert answers and answers[-1] in (Slept.WOKEN, Slept.CHANGED)
    peer_cell = words.data_ptr() + 8 * (SLOTS_PER_WORKER + WRITTEN)
    assert woken == [peer_cell]  # the first post found nobody asleep; the peer's woke its counter's sleeper
    assert int(words[shm_signals._ASLEEP]) == 0  # awake again: the peer's next post makes no system call


def test_a_post_wakes_only_where_a_peer_says_it_sleeps():
    """The wake is a system call (3 us): a post makes it only while a peer's line says it sleeps
    in the kernel, which the sleeper writes before its sleep begins and clears after."""
    woken: list[int] = []
    flagged_while_asleep: list[int] = []
    words = torch.zeros(2 * SLOTS_PER_WORKER, dtype=torch.int64)
    asleep_word = SLOTS_PER_WORKER + shm_signals._ASLEEP  # the second worker's

    class Recording:
        def wait(self, address, seen, seconds):
            flagged_while_asleep.append(int(words[asleep_word]))
            return Slept.TIMED_OUT

        def wake(self, address):
            woken.append(address)

    first = SharedSignals(words, 0, 2, 5.0, NAMES, futex=Recording())
    second = SharedSignals(words, 1, 2, 5.0, NAMES, policy=_SleepAtOnce(), futex=Recording())
    first.post(WRITTEN)
    assert woken == []  # nobody asleep: no system call
    words[asleep_word] = 1  # what the second worker writes before it sleeps
    first.post(ARRIVED)
    assert woken == [words.data_ptr() + 8 * ARRIVED]
    words[asleep_word] = 0
    thread = threading.Thread(target=lambda: (time.sleep(0.02), first.post(WRITTEN)))
    thread.start()
    second.post(WRITTEN)
    second.wait(WRITTEN, second.post(WRITTEN))  # count 2: sleeps (recorded) until the first posts again
    thread.join()
    assert flagged_while_asleep and set(flagged_while_asleep) == {1}
    assert int(words[asleep_word]) == 0


def test_a_futex_the_kernel_refuses_gives_way_to_timed_sleeps_for_good():
    """A futex call that fails (not a wake, a timeout or a changed word) would return at once every
    time, a busy loop: the signals sleep in timed sleeps from then on, and posts stop waking."""
    calls: list[str] = []

    class Refused:
        def wait(self, address, seen, seconds):
            calls.append("wait")
            return Slept.FAILED

        def wake(self, address):
            calls.append("wake")

    words = torch.zeros(2 * SLOTS_PER_WORKER, dtype=torch.int64)
    first = SharedSignals(words, 0, 2, 5.0, NAMES, policy=_SleepAtOnce(), futex=Refused())
    second = SharedSignals(words, 1, 2, 5.0, NAMES)
    thread = threading.Thread(target=lambda: (time.sleep(0.05), second.post(WRITTEN)))
    thread.start()
    first.wait(WRITTEN, first.post(WRITTEN))
    thread.join()
    assert calls == ["wait"]  # one refused sleep, then timed sleeps until the peer posted
    words[SLOTS_PER_WORKER + shm_signals._ASLEEP] = 1  # even with a peer asleep
    first.post(ARRIVED)
    assert calls == ["wait"]


def test_the_workers_signals_sleep_on_the_kernels_futex():
    """``make_signals`` (what the shared-memory engine makes) gives the signals the kernel's futex:
    without it every wait past its poll would fall back to timed sleeps, unseen."""
    words = torch.zeros(SLOTS_PER_WORKER, dtype=torch.int64)
    signals = shm_signals.make_signals(words, 0, 1, 5.0, ["worker:0"], barrier=lambda: None)
    assert isinstance(signals._futex, shm_signals.Futex)
