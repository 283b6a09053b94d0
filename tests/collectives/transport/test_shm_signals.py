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
from unison._collectives.transport.shm_signals import ARRIVED, SLOTS_PER_WORKER, WRITTEN, SharedSignals

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
