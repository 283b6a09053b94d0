"""Tests of ``run_workers``: results by rank, failures, timeouts and killed workers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.distributed as dist

from unison._testing import (
    WorkerFailure,
    WorkerResult,
    WorkerTimeout,
    connect_rendezvous_store,
    leaks,
    run_workers,
)


def _report(rank: int, world_size: int, offset: int) -> dict[str, object]:
    names = ("GLOO_SOCKET_IFNAME", "OMP_NUM_THREADS", "MASTER_ADDR", "UNISON_RENDEZVOUS")
    return {
        "rank": rank,
        "world_size": world_size,
        "value": rank + offset,
        "env": {name: os.environ.get(name) for name in names + ("UNISON_TEST_EXTRA",)},
        "torch_threads": torch.get_num_threads(),
        "pid": os.getpid(),
    }


@pytest.fixture(scope="module")
def reports() -> list[dict[str, object]]:
    """One run of 2 workers, shared by the tests that inspect it."""
    offset = 100

    def closure(rank: int, world_size: int) -> dict[str, object]:  # Needs cloudpickle.
        return _report(rank, world_size, offset)

    return run_workers(closure, 2, timeout=60, env={"UNISON_TEST_EXTRA": "yes"})


@pytest.mark.timeout(90)
def test_returns_values_in_rank_order(reports: list[dict[str, object]]) -> None:
    assert [r["rank"] for r in reports] == [0, 1]
    assert [r["value"] for r in reports] == [100, 101]
    assert {r["world_size"] for r in reports} == {2}
    assert reports[0]["pid"] != reports[1]["pid"] != os.getpid()


@pytest.mark.timeout(90)
def test_workers_get_the_test_environment(reports: list[dict[str, object]]) -> None:
    for report in reports:
        env = report["env"]
        assert isinstance(env, dict)
        assert env["GLOO_SOCKET_IFNAME"] == "lo"
        assert env["OMP_NUM_THREADS"] == "1"
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert env["UNISON_TEST_EXTRA"] == "yes"
        assert str(env["UNISON_RENDEZVOUS"]).startswith("127.0.0.1:")
        assert report["torch_threads"] == 1
    assert "UNISON_TEST_EXTRA" not in os.environ  # The parent's environment is untouched.


def _fail_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError(f"boom from rank {rank}")
    return rank


def _environment_and_parent(rank: int, world_size: int) -> tuple[str | None, int]:
    return os.environ.get("UNISON_SET_BY_THE_TEST"), os.getppid()


@pytest.mark.timeout(60)
@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="workers are spawned where Linux has no pidfd_open")
def test_workers_start_from_the_fork_server_with_the_tests_current_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Forked from a server that imported torch once (not spawned: no second import of
    # torch per worker), yet started with what the test's environment is now, as spawn's.
    monkeypatch.setenv("UNISON_SET_BY_THE_TEST", "now")
    results = run_workers(_environment_and_parent, 2, timeout=30)
    server = leaks.fork_server_pid()
    assert results == [("now", server), ("now", server)]
    monkeypatch.delenv("UNISON_SET_BY_THE_TEST")
    assert [value for value, _ in run_workers(_environment_and_parent, 2, timeout=30)] == [None, None]


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except OSError:
        return True


@pytest.mark.timeout(90)
def test_workers_end_when_the_test_process_is_killed(tmp_path) -> None:
    # A worker's parent is the fork server, not the test process: it must still notice
    # that the test process died, and end instead of lingering as an orphan.
    pids = tmp_path / "pids"
    script = tmp_path / "test_process.py"
    script.write_text(textwrap.dedent(f"""
        import os, threading
        from unison._testing import run_workers

        def wait_forever(rank, world_size):
            path = {str(pids)!r} + str(rank)
            with open(path + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.replace(path + ".tmp", path)  # the file appears whole
            threading.Event().wait()

        if __name__ == "__main__":
            run_workers(wait_forever, 2, timeout=300)
    """))
    stderr = tmp_path / "stderr"
    with open(stderr, "wb") as sink:  # a file, not a pipe: an orphan holding it must not block the test
        test_process = subprocess.Popen([sys.executable, str(script)], stderr=sink)
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"pids{rank}").is_file() for rank in (0, 1)):
            if test_process.poll() is not None:
                pytest.fail(f"the test process ended before its workers started: {stderr.read_text()}")
            assert time.monotonic() < deadline, "workers never started"
            time.sleep(0.05)
        workers = [int((tmp_path / f"pids{rank}").read_text()) for rank in (0, 1)]
    finally:
        test_process.kill()
        test_process.wait()
    deadline = time.monotonic() + 10
    while not all(_gone(pid) for pid in workers):
        assert time.monotonic() < deadline, f"workers {workers} outlived the test process"
        time.sleep(0.05)


@pytest.mark.timeout(60)
def test_exception_in_rank_1_raises_worker_failure_with_its_traceback() -> None:
    with pytest.raises(WorkerFailure, match=r"rank\(s\) \[1\]") as info:
        run_workers(_fail_on_rank_1, 2, timeout=30)
    failure = info.value
    assert isinstance(failure, AssertionError)
    assert failure.failed_ranks == (1,)
    message = str(failure)
    assert "rank 1 raised:" in message
    assert "ValueError: boom from rank 1" in message
    assert "in _fail_on_rank_1" in message  # The worker's own frame.
    assert failure.results[0] == WorkerResult(0, 0, 0, None, "")
    assert failure.results[1].exitcode == 1


def _wait_forever_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        threading.Event().wait()
    return rank


@pytest.mark.timeout(60)
def test_hung_worker_raises_worker_timeout_with_its_stack_and_leaves_no_process() -> None:
    before = leaks.snapshot()
    timeout = 8.0  # Start-up counts too: rank 1 must reach fn to have a stack to show.
    start = time.monotonic()
    with pytest.raises(WorkerTimeout, match=r"timed out after 8 s: rank\(s\) \[1\]") as info:
        run_workers(_wait_forever_on_rank_1, 2, timeout=timeout)
    elapsed = time.monotonic() - start
    assert elapsed < timeout + 4
    error = info.value
    assert isinstance(error, TimeoutError)
    assert error.failed_ranks == (1,)
    assert error.results[0].ok and error.results[0].value == 0
    assert error.results[1].exitcode == -signal.SIGKILL
    assert "in _wait_forever_on_rank_1" in str(error)  # faulthandler's stack of rank 1.
    assert "watch_parent" not in str(error)  # The harness's own thread is left out.
    _, leaked = leaks.find_leaks(before, settle=0)
    assert leaked == []


def _rank_1_killed_mid_collective(rank: int, world_size: int) -> object:
    store = dist.PrefixStore("fault", connect_rendezvous_store(timeout=20))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size,
        timeout=__import__("datetime").timedelta(seconds=10),
    )
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        dist.all_reduce(torch.ones(4))
    except Exception as exc:  # The survivor reports what it saw.
        return exc
    return "all_reduce completed without its peer"


@pytest.mark.timeout(60)
def test_sigkilled_worker_reports_exitcode_minus_9_with_allow_failures() -> None:
    results = run_workers(_rank_1_killed_mid_collective, 2, timeout=30, allow_failures=True)
    assert [r.rank for r in results] == [0, 1]
    survivor, killed = results
    assert survivor.ok and survivor.exitcode == 0
    assert isinstance(survivor.value, RuntimeError), survivor.value
    assert killed.exitcode == -9
    assert killed.value is None
    assert killed.error is not None and "SIGKILL" in killed.error


def _all_reduce(rank: int, world_size: int) -> list[float]:
    from datetime import timedelta

    store = dist.PrefixStore("test-all-reduce", connect_rendezvous_store(timeout=20))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=15)
    )
    tensor = torch.tensor([1.0, 2.0]) * (rank + 1)
    dist.all_reduce(tensor)
    return tensor.tolist()  # The harness destroys the group when fn returns.


@pytest.mark.timeout(60)
def test_gloo_all_reduce_through_the_rendezvous_store() -> None:
    assert run_workers(_all_reduce, 2, timeout=30) == [[3.0, 6.0], [3.0, 6.0]]


@pytest.mark.timeout(10)
def test_bad_arguments_are_rejected_before_any_process_starts() -> None:
    with pytest.raises(TypeError, match="must be callable"):
        run_workers("not a function")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"world_size=0"):
        run_workers(_fail_on_rank_1, 0)
    with pytest.raises(ValueError, match=r"timeout=0"):
        run_workers(_fail_on_rank_1, 2, timeout=0)
