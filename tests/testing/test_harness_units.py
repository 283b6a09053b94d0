"""In-process tests of the harness's pieces: errors, rendezvous helpers, leak checks."""

from __future__ import annotations

import pickle
import socket
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
def test_free_port_is_released_and_never_one_held() -> None:
    port = free_port()
    with socket.socket() as held:
        held.bind(("127.0.0.1", port))  # released before it was returned: binding it works
        held.listen(1)
        assert free_port() != port  # a port something holds is never handed out


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
    ``SERIAL_FILES``, or xdist would run it beside another launch.

    A file launches if its text does so in any of the ways below, or if it imports a helper
    module under ``tests/`` that does. The patterns are checked against samples of each
    way (and of prose that only names the launcher), and the launcher's entry functions
    against ``unison.launch``, so that neither can go stale unnoticed.
    """
    import ast
    import importlib
    import re
    from pathlib import Path

    from tests.conftest import SERIAL_FILES

    entry_points = {  # the launcher's functions that run a cluster, and where they live
        "launch_main": "unison._launch.cli", "run_local_cluster": "unison._launch.local_run",
        "run_keeping_ps_tasks": "unison._launch.kept_ps", "run_node": "unison._launch.multinode",
        "launch_nodes": "unison._launch.multinode_flags", "LocalCluster": "unison._launch.procs",
    }
    for name, module in entry_points.items():
        assert hasattr(importlib.import_module(module), name), f"{module}.{name} is gone: update the guard"
    ways = {
        r"""-m["',\s]+unison\.launch\b""": '[sys.executable, "-m", "unison.launch", "--workers", "2"]',
        r"""\bmain\(\s*(?:argv\s*=\s*)?[\[(]\s*["']launch["']""": 'code = main(["launch", "--workers", "2", script])',
        r"\b(?:" + "|".join(entry_points) + r")\s*\(": "run_local_cluster(command, tasks, authkey=key)",
        r"""["'](?:[^"'\s]*/)?unison["']\s*,\s*["']launch["']""": 'subprocess.run(["unison", "launch", script])',
        r"""\bwhich\(\s*["']unison["']\s*\)""": 'subprocess.run([shutil.which("unison"), "launch", script])',
        r"\b(?:simulated_hosts|SimulatedHosts)\s*\(": "hosts = simulated_hosts(2)",
    }
    patterns = [re.compile(pattern) for pattern in ways]
    for pattern, sample in zip(patterns, ways.values()):
        assert pattern.search(sample), (pattern.pattern, sample)
    for prose in ['"""Under ``unison launch --workers 2``."""', 'assert "unison launch --max-restarts" in advice',
                  'sys.exit(main(["server"]))', "from unison._launch.cli import main"]:
        assert not any(pattern.search(prose) for pattern in patterns), prose

    root = Path(__file__).resolve().parents[2]
    this_file = Path(__file__).resolve()

    def launches_itself(path: Path) -> bool:
        return path.resolve() != this_file and any(pattern.search(path.read_text()) for pattern in patterns)

    def imported(path: Path) -> set[str]:
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
        return names

    sources = [path for path in (root / "tests").rglob("*.py") if path.name != "conftest.py"]
    helpers = {".".join(path.relative_to(root).with_suffix("").parts) for path in sources
               if not path.name.startswith("test_") and launches_itself(path)}
    launching = {path.relative_to(root).as_posix() for path in sources if path.name.startswith("test_")
                 and (launches_itself(path) or imported(path) & helpers)}
    assert launching, "the scan found no launching test file: its patterns are stale"
    assert launching <= SERIAL_FILES, sorted(launching - SERIAL_FILES)
    assert all((root / name).is_file() for name in SERIAL_FILES), sorted(
        name for name in SERIAL_FILES if not (root / name).is_file())
