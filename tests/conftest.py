"""Fixtures shared by the whole test suite.

Every test runs with three cheap guards (autouse): ``os.environ`` is restored after it,
a default ``torch.distributed`` process group it left initialised is destroyed, and it
fails if it leaves non-daemon threads or child processes running. Outside ``tests/gpu``
the processes a test starts see no GPU. Multi-process tests
use ``unison._testing.run_workers`` or the session's warm ``worker_pool``. Hypothesis runs
under one profile for the suite (no deadline), and the run's summary says how many
multi-host tests ran.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, settings

from unison._testing import WorkerPool, leaks, rendezvous

# One Hypothesis policy for the whole suite. No deadline and no too_slow health check:
# both judge an example by wall-clock time, which on two busy cores says more about the
# neighbours than about the code (the default 200 ms deadline fails an example that was only slow).
# 100 examples unless a test asks for others. Under CI the examples are derandomized (the
# same every run: a red run is a regression, not an unlucky draw); elsewhere they vary, and
# a failure prints the blob for ``@reproduce_failure``. ``--hypothesis-profile`` overrides.
settings.register_profile("dev", deadline=None, max_examples=100, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", settings.get_profile("dev"), derandomize=True, database=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


SERIAL_FILES = frozenset({
    "tests/checkpoint/test_backup_resume.py",
    "tests/checkpoint/test_preemption.py",
    "tests/checkpoint/test_sidecar.py",
    "tests/cluster/test_slurm_jobs.py",
    "tests/coordinator/test_coordinator_strategy.py",
    "tests/coordinator/test_independent_worker.py",
    "tests/docs/test_from_tensorflow.py",
    "tests/examples/test_ctr_example.py",
    "tests/examples/test_online_ctr_example.py",
    "tests/launch/test_core_binding.py",
    "tests/launch/test_launch.py",
    "tests/launch/test_kept_ps.py",
    "tests/launch/test_launch_integration.py",
    "tests/launch/test_launcher_signals.py",
    "tests/multinode/test_multinode_launch.py",
    "tests/multinode/test_node_rendezvous.py",
    "tests/multinode/test_simulated_hosts.py",
    "tests/placement/test_ensemble_example.py",
    "tests/ps/test_launch_ps.py",
})
"""Test files that run ``unison launch`` (each launch starts several interpreters that import
torch), simulated hosts, or whole SLURM-like jobs on ports derived from job ids. Under
xdist they all go to one worker, one test at a time, so two of them never compete for the
cores: their wall-clock bounds (a failure named within a timeout) were sized for a
machine that runs one launch at a time. ``tests/testing`` checks that every launching
file is listed."""

_REPO = Path(__file__).resolve().parents[1]


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups (``--dist loadgroup``)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        path = Path(str(item.path)).resolve()
        if path.is_relative_to(_REPO) and path.relative_to(_REPO).as_posix() in SERIAL_FILES:
            item.add_marker(pytest.mark.xdist_group("launches"))


MULTI_HOST_TESTS = Path(__file__).resolve().parent / "multinode"


class _MultiHostCount:
    """Counts the tests in ``tests/multinode`` that ran and that skipped, for the summary.

    They need root, ``ip``, ``unshare`` and network namespaces and skip elsewhere, so a run
    without them is green without having run them; the summary line says so. Registered on
    the controlling process only: under xdist the workers' reports arrive there through
    ``pytest_runtest_logreport``.
    """

    def __init__(self, rootpath: Path):
        self._rootpath = rootpath
        self._outcomes: dict[str, str] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        path = (self._rootpath / report.nodeid.split("::", 1)[0]).resolve()
        if MULTI_HOST_TESTS not in path.parents:
            return
        if report.skipped and not hasattr(report, "wasxfail"):
            self._outcomes[report.nodeid] = "skipped"  # by the fixture (setup) or in the test
        elif report.when == "call":
            self._outcomes[report.nodeid] = "ran"
        elif report.failed and report.nodeid not in self._outcomes:
            self._outcomes[report.nodeid] = "error"  # setup failed: it never ran

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self._outcomes:
            return
        counts = {kind: list(self._outcomes.values()).count(kind) for kind in ("ran", "skipped", "error")}
        line = f"multi-host tests (tests/multinode): {counts['ran']} ran, {counts['skipped']} skipped"
        if counts["error"]:
            line += f", {counts['error']} errors in setup"
        if counts["skipped"]:
            line += " (simulated hosts need root, `ip`, `unshare` and network namespaces; -ra lists why)"
        terminalreporter.write_line(line, yellow=bool(counts["skipped"]), bold=True)


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # not an xdist worker
        config.pluginmanager.register(_MultiHostCount(config.rootpath), "unison-multi-host-count")
        return
    _share_the_cores(int(config.workerinput["workercount"]))


def _share_the_cores(pytest_workers: int) -> None:
    """Gives each xdist worker its share of the cores as intra-op threads.

    torch's default is one thread per core in *every* process. Two pytest workers on two
    cores then run four OpenMP threads that spin while they wait for each other, beside the
    interpreters the launch tests start: an in-process training test that took 14 s alone
    took 100 s in the full run (48 s beside one busy process; 21 s with one thread). A test
    that needs another count sets it and restores it, as before.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, cores // max(1, pytest_workers)))


@pytest.fixture(scope="session")
def worker_pool() -> Iterator[WorkerPool]:
    """A pool of 2 warm worker processes sharing a gloo process group.

    For the many small collective tests: ``worker_pool.run(fn, *args, timeout=...)``
    runs ``fn(rank, world_size, *args)`` on both members and returns the results by
    rank. The processes start on the first ``run``; a failure that leaves a member
    dead or stuck makes the pool restart on the next call. Tests that form or
    destroy process groups, or kill workers, use ``run_workers`` instead.
    """
    pool = WorkerPool(world_size=2)
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture(autouse=True)
def _no_leaked_threads_or_processes(worker_pool: WorkerPool) -> Iterator[None]:
    """Fails a test that leaves non-daemon threads or child processes running.

    The pool's members are expected to outlive tests; requesting the pool here only
    creates the (idle) object, it starts no process.
    """
    before = leaks.snapshot()
    yield
    threads, pids = leaks.find_leaks(before, ignore_pids=worker_pool.pids)
    if pids:
        leaks.kill_processes(pids)  # So the leak cannot disturb later tests.
    if threads or pids:
        names = [t.name for t in threads]
        pytest.fail(
            f"test leaked non-daemon threads {names} and/or child processes {pids} "
            "(processes were killed); join threads and end processes before returning",
            pytrace=False,
        )


@pytest.fixture(autouse=True)
def _restore_environ() -> Iterator[None]:
    """Restores ``os.environ`` after each test."""
    saved = dict(os.environ)
    yield
    if dict(os.environ) != saved:
        os.environ.clear()
        os.environ.update(saved)


GPU_TESTS = Path(__file__).resolve().parent / "gpu"
if torch.cuda.is_available():
    # This process's CUDA is decided now, before a test hides GPUs from its children. The
    # availability check caches the driver's count, but until CUDA is initialised
    # ``torch.cuda.device_count()`` re-reads ``CUDA_VISIBLE_DEVICES`` through NVML: under
    # the hider below it said 0 while ``is_available()`` said True, and Dynamo's device
    # properties (listed by that count) then failed every in-process ``torch.compile`` test
    # with an IndexError (H200, torch 2.11). After ``init()`` the count is cached too. A
    # CUDA that fails to initialise is left for the GPU tests to report, not the whole suite.
    with contextlib.suppress(RuntimeError):
        torch.cuda.init()
        torch.cuda.device_count()
_SESSION_CUDA_VISIBLE_DEVICES = os.environ.get("CUDA_VISIBLE_DEVICES")


@pytest.fixture
def session_cuda_visible_devices() -> str | None:
    """``CUDA_VISIBLE_DEVICES`` as the test session found it (None: unset)."""
    return _SESSION_CUDA_VISIBLE_DEVICES


@pytest.fixture(scope="module", autouse=True)
def _cpu_only_worker_processes(request: pytest.FixtureRequest) -> Iterator[None]:
    """Processes a test module starts see no GPU, except under ``tests/gpu``.

    The suite's multi-process tests are CPU tests (CI has no GPU): on a machine with one,
    their workers' default devices would otherwise be the GPU, which their CPU batches
    do not expect. Module-scoped, so that a module's own module-scoped fixtures (a
    reference run launched once per file) start after it and hide the GPU too; a
    function-scoped hider came after them, and on a GPU machine their reference runs
    trained on ``cuda:0``. The module's end restores the session's value, so a later
    GPU test sees the GPU again. This process decided its CUDA at import and keeps it.
    """
    if GPU_TESTS in Path(str(request.path)).resolve().parents:
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CUDA_VISIBLE_DEVICES", "")
        yield


@pytest.fixture(autouse=True)
def _destroy_default_process_group() -> Iterator[None]:
    """Destroys a default process group that a test left initialised."""
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def free_port() -> int:
    """A TCP port that was free a moment ago, for address *strings* only.

    The port is released before the test gets it, so another process may take it:
    never use it to rendezvous. Real rendezvous goes through the store the parent
    serves on port 0 (``run_workers`` passes it in ``UNISON_RENDEZVOUS``).
    """
    return rendezvous.free_port()
