"""While replica threads run a step, the GIL switch interval is short; the caller's comes back after.

Replica threads contend for the GIL between native ops; the default 5 ms switch interval
let one thread keep it while another waited (see ``_strategies/switch_interval.py``).
The interval is process-wide, so it must be the caller's again after every run: after a
replica raised, with runs of two strategies at once, and a caller's own shorter
interval is kept.
"""

from __future__ import annotations

import sys
import threading

import pytest

import unison
from unison._strategies.switch_interval import REPLICA_SWITCH_INTERVAL_S, ShortSwitchInterval

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def default_interval():
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield
    sys.setswitchinterval(before)


def _seen_intervals(strategy, fn=None):
    seen = []

    def step():
        seen.append(sys.getswitchinterval())
        if fn is not None:
            fn()

    strategy.run(step)
    return seen


def test_replicas_run_with_the_short_interval_and_the_callers_comes_back(default_interval):
    strategy = unison.MirroredStrategy(["cpu:0", "cpu:1"])
    seen = _seen_intervals(strategy)
    assert seen == pytest.approx([REPLICA_SWITCH_INTERVAL_S] * 2)
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_one_replica_runs_inline_with_the_callers_interval(default_interval):
    assert _seen_intervals(unison.OneDeviceStrategy("cpu:0")) == pytest.approx([0.005])


def test_the_callers_interval_comes_back_when_a_replica_raises(default_interval):
    strategy = unison.MirroredStrategy(["cpu:0", "cpu:1"])

    def fails():
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        _seen_intervals(strategy, fails)
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_a_shorter_interval_of_the_caller_is_kept():
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.0001)
    try:
        seen = _seen_intervals(unison.MirroredStrategy(["cpu:0", "cpu:1"]))
        assert seen == pytest.approx([0.0001] * 2)
        assert sys.getswitchinterval() == pytest.approx(0.0001)
    finally:
        sys.setswitchinterval(before)


def test_concurrent_runs_restore_the_callers_interval_after_the_last(default_interval):
    first, second = unison.MirroredStrategy(["cpu:0", "cpu:1"]), unison.MirroredStrategy(["cpu:0", "cpu:1"])
    inside = threading.Barrier(4, timeout=20)  # both runs' replicas inside at once
    seen = []

    def step():
        inside.wait()
        seen.append(sys.getswitchinterval())
        inside.wait()

    other = threading.Thread(target=lambda: second.run(step))
    other.start()
    first.run(step)
    other.join(20)
    assert seen == pytest.approx([REPLICA_SWITCH_INTERVAL_S] * 4)
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_nested_entries_restore_once_and_keep_a_change_made_meanwhile(default_interval):
    short = ShortSwitchInterval(0.001)
    with short:
        with short:
            assert sys.getswitchinterval() == pytest.approx(0.001)
        assert sys.getswitchinterval() == pytest.approx(0.001)  # the outer entry still runs
    assert sys.getswitchinterval() == pytest.approx(0.005)
    with short:
        sys.setswitchinterval(0.002)  # someone else's change during a run is theirs to keep
    assert sys.getswitchinterval() == pytest.approx(0.002)
