"""In-process tests of the harness's pieces: errors, rendezvous helpers, leak checks."""

from __future__ import annotations

import pickle
import subprocess
import sys
import threading

import pytest

from unison._testing import (
    RENDEZVOUS_ENV,
    WorkerFailure,
    WorkerResult,
    WorkerTimeout,
    connect_rendezvous_store,
    free_port,
    leaks,
)


def _results() -> list[WorkerResult]:
    return [
        WorkerResult(0, 0, "fine"),
        WorkerResult(1, 1, None, "rank 1 raised:\nValueError: bad", "some log line\n"),
    ]


@pytest.mark.timeout(10)
def test_worker_failure_is_an_assertion_error_naming_the_failed_rank() -> None:
    failure = WorkerFailure(_results())
    assert isinstance(failure, AssertionError)
    assert failure.failed_ranks == (1,)
    message = str(failure)
    assert message.startswith("worker rank(s) [1] of world_size 2 failed")
    assert "===== rank 1 (exit code 1) =====" in message
    assert "ValueError: bad" in message and "some log line" in message
    assert "rank 0" not in message
    copy = pickle.loads(pickle.dumps(failure))
    assert str(copy) == message and copy.results == failure.results


@pytest.mark.timeout(10)
def test_worker_timeout_is_both_a_worker_failure_and_a_timeout_error() -> None:
    timeout = WorkerTimeout(_results(), "timed out after 1 s")
    assert isinstance(timeout, WorkerFailure)
    assert isinstance(timeout, TimeoutError)
    assert str(timeout).startswith("timed out after 1 s\n")


@pytest.mark.timeout(10)
def test_connect_rendezvous_store_explains_a_missing_or_bad_address(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(RENDEZVOUS_ENV, raising=False)
    with pytest.raises(RuntimeError, match="UNISON_RENDEZVOUS is not set"):
        connect_rendezvous_store()
    monkeypatch.setenv(RENDEZVOUS_ENV, "localhost")
    with pytest.raises(ValueError, match="'localhost' is not a 'host:port' address"):
        connect_rendezvous_store()


@pytest.mark.timeout(10)
def test_free_port_is_a_port_number() -> None:
    assert 0 < free_port() < 65536


@pytest.mark.timeout(30)
def test_leak_check_finds_a_running_thread_and_child_process() -> None:
    before = leaks.snapshot()
    release = threading.Event()
    thread = threading.Thread(target=release.wait, name="leaky-thread")
    thread.start()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        threads, pids = leaks.find_leaks(before, settle=0.1)
        assert [t.name for t in threads] == ["leaky-thread"]
        assert pids == [child.pid]
    finally:
        release.set()
        thread.join()
        leaks.kill_processes([child.pid])
        child.wait()
    assert child.returncode == -9
    assert leaks.find_leaks(before, settle=0) == ([], [])


def test_every_file_that_launches_clusters_runs_in_the_serial_group():
    """A new test file that runs ``unison launch`` or simulated hosts must join
    ``SERIAL_FILES``, or xdist would run it beside another launch."""
    from pathlib import Path

    from tests.conftest import SERIAL_FILES

    root = Path(__file__).resolve().parents[2]

    def launches(path: Path) -> bool:
        text = path.read_text()
        return '"-m", "unison.launch"' in text or "simulated_hosts(" in text

    this_file = Path(__file__).resolve()
    launching = {path.relative_to(root).as_posix() for path in (root / "tests").rglob("test_*.py")
                 if path.resolve() != this_file and launches(path)}
    assert launching, "the scan found no launching test file: its patterns are stale"
    assert launching <= SERIAL_FILES, sorted(launching - SERIAL_FILES)
    assert all((root / name).is_file() for name in SERIAL_FILES), sorted(
        name for name in SERIAL_FILES if not (root / name).is_file())
