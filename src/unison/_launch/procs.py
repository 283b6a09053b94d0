"""Process management for ``unison launch``: one process per task of a local cluster.

Each task runs in its own session (so its process group holds it and anything it
starts); its stdout and stderr are read line by line and forwarded with a
``[worker:1]`` prefix (``task_output``: progress bars redraw in place on a terminal
and become whole lines in a log). When a task fails, every other task's group receives SIGTERM,
then SIGKILL after a grace period, and the cluster reports the failed task and its
exit code; with restarts left, the whole cluster is started again on fresh ports.

On Linux each task also dies with the launcher: a launcher killed with SIGKILL cannot
stop its tasks, and tasks in sessions of their own would otherwise train on as orphans
(see ``parent_death.die_with_launcher``). How a run ended is an ``outcome.Outcome``; the
launcher's own SIGTERM and SIGHUP stop the cluster through ``interrupts``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO

from unison._cluster import env
from unison._launch.core_binding import describe_plan, started_on
from unison._launch.interrupts import SIGNAL_POLL_S, helper_threads_block_signals
from unison._launch.outcome import Outcome, exit_code
from unison._launch.parent_death import die_with_launcher
from unison._launch.task_output import OutputRelay, is_terminal, terminal_streams

__all__ = ["Task", "plan_tasks", "reserve_ports", "cluster_environments", "shared_environment", "LocalCluster",
           "Outcome", "exit_code", "die_with_launcher"]


@dataclasses.dataclass(frozen=True)
class Task:
    """One task of the local cluster."""

    type: str
    index: int

    @property
    def name(self) -> str:
        """``"worker:1"``: how output lines and messages name the task."""
        return f"{self.type}:{self.index}"


def plan_tasks(workers: int, chief: bool = False, ps: int = 0, evaluator: bool = False) -> list[Task]:
    """The tasks of a local cluster, chief first, then workers, ps, evaluator.

    Raises:
        ValueError: for negative counts or a cluster with neither chief nor worker.
    """
    for name, count in (("workers", workers), ("ps", ps)):
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"--{name} {count!r} is not a non-negative integer; fix --{name}")
    if workers == 0 and not chief:
        raise ValueError("a cluster needs a chief or at least one worker; pass --workers N (N >= 1) or --chief")
    tasks = [Task("chief", 0)] if chief else []
    tasks += [Task("worker", i) for i in range(workers)]
    tasks += [Task("ps", i) for i in range(ps)]
    tasks += [Task("evaluator", 0)] if evaluator else []
    return tasks


def reserve_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports that were free on ``host`` (bound to port 0 together, then released)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def shared_environment(
    base: Mapping[str, str], *, authkey: bytes, coordinator_port: int, restart: int
) -> dict[str, str]:
    """The environment every task of a cluster shares: key, coordination port, restart count, threads."""
    shared = dict(base)
    shared.pop(env.UNISON_AUTHKEY_FILE, None)  # this cluster's key replaces any other
    shared[env.UNISON_AUTHKEY] = authkey.hex()
    shared[env.UNISON_COORDINATOR_PORT] = str(coordinator_port)
    shared[env.UNISON_RESTART_COUNT] = str(restart)
    shared.setdefault("OMP_NUM_THREADS", "1")
    shared["PYTHONUNBUFFERED"] = "1"
    return shared


def cluster_environments(
    tasks: Sequence[Task],
    *,
    authkey: bytes,
    restart: int,
    base: Mapping[str, str],
    host: str = "127.0.0.1",
    kept: Mapping[str, list[str]] | None = None,
) -> dict[Task, dict[str, str]]:
    """The environment of every task: TF_CONFIG, key, coordination port, thread settings.

    Ports are reserved afresh on each call (each restart), so a new cluster never
    waits for sockets of the previous one; the jobs in ``kept`` keep those addresses
    (ps tasks that live on across a restart of the others).
    """
    kept = dict(kept or {})
    fresh = [task for task in tasks if task.type not in kept]
    ports = reserve_ports(len(fresh) + 1, host)
    cluster: dict[str, list[str]] = {}
    for task in tasks:
        if task.type in kept:
            cluster[task.type] = list(kept[task.type])
    for task, port in zip(fresh, ports):
        cluster.setdefault(task.type, []).append(f"{host}:{port}")
    shared = shared_environment(base, authkey=authkey, coordinator_port=ports[-1], restart=restart)
    result = {}
    for task in tasks:
        task_env = dict(shared)
        task_env[env.TF_CONFIG] = json.dumps({"cluster": cluster, "task": {"type": task.type, "index": task.index}})
        result[task] = task_env
    return result


class _Pump(threading.Thread):
    """Copies one pipe of a task to a stream of the launcher, through an ``OutputRelay``.

    One prefix a line; carriage returns (progress bars) redraw in place on a terminal
    and become whole lines elsewhere (``unison._launch.task_output``).
    """

    def __init__(self, pipe: IO[bytes], prefix: str, sink: IO[str], lock: threading.Lock):
        super().__init__(name=f"unison-pump-{prefix}", daemon=True)
        self._pipe, self._sink, self._lock = pipe, sink, lock
        self._relay = OutputRelay(prefix, terminal=is_terminal(sink))

    def run(self) -> None:
        with self._pipe:
            fd = self._pipe.fileno()
            while chunk := os.read(fd, 65536):
                self._write(self._relay.feed(chunk))
        self._write(self._relay.close())

    def _write(self, text: str) -> None:
        if text:
            with self._lock:
                self._sink.write(text)
                self._sink.flush()


def _group_alive(pgid: int) -> bool:
    """Whether a process group still has a running (non-zombie) member."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    if not os.path.isdir("/proc"):
        return True
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rpartition(b")")[2].split()
        except OSError:
            continue
        # After the command name: state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] != b"Z":
            return True
    return False


@dataclasses.dataclass
class _Running:
    task: Task
    process: subprocess.Popen[bytes]
    pumps: list[_Pump]



class LocalCluster:
    """One run of every task of a local cluster.

    Args:
        command: the program, e.g. ``[sys.executable, "train.py", "--lr", "0.1"]``.
        environments: each task's environment (see ``cluster_environments``).
        grace_period: seconds between SIGTERM and SIGKILL when stopping tasks.
        stdout: where prefixed stdout lines go.
        stderr: where prefixed stderr lines and launcher messages go.
        settle_period: seconds the other tasks get to end by themselves after one
            failed, before SIGTERM (their collectives see the lost peer and name it).
        cores: the CPUs each task runs on (``unison._launch.core_binding``); None: unbound.
    """

    def __init__(
        self,
        command: Sequence[str],
        environments: Mapping[Task, Mapping[str, str]],
        *,
        grace_period: float,
        stdout: IO[str],
        stderr: IO[str],
        settle_period: float = 0.0,
        cores: Mapping[Task, Sequence[int]] | None = None,
    ):
        self._settle = settle_period
        self._cores = dict(cores or {})
        self._command = list(command)
        self._environments = environments
        self._grace = grace_period
        self._stdout, self._stderr = stdout, stderr
        self._locks = {id(stdout): threading.Lock(), id(stderr): threading.Lock()}
        self._running: list[_Running] = []
        self._exits: queue.Queue[_Running] = queue.Queue()
        self._notices: str | None = None  # where signalled tasks name themselves; removed by stop()

    def exited(self) -> list[str]:
        """The tasks whose process has ended, by name."""
        return [r.task.name for r in self._running if r.process.poll() is not None]

    def message(self, text: str) -> None:
        """Writes a launcher message to stderr, between task lines."""
        with self._locks[id(self._stderr)]:
            self._stderr.write(f"unison launch: {text}\n")
            self._stderr.flush()

    def start(self) -> None:
        """Starts every task, each in a new session."""
        self._notices = tempfile.mkdtemp(prefix="unison-preemption-notices-")
        terminal = terminal_streams(self._stdout, self._stderr)
        bound = {task.name: self._cores[task] for task in self._environments if task in self._cores}
        if bound:
            self.message(f"bound {describe_plan(bound)}")
        for task, task_env in self._environments.items():
            with started_on(self._cores.get(task)):  # inherited from the first instruction on
                process = subprocess.Popen(
                    die_with_launcher(self._command),
                    env={**task_env, env.UNISON_PREEMPTION_NOTICES: self._notices, env.UNISON_TERMINAL: terminal},
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,
                )
            prefix = f"[{task.name}]"
            out_pipe, err_pipe = process.stdout, process.stderr
            if out_pipe is None or err_pipe is None:  # pragma: no cover - PIPE always gives both
                raise RuntimeError("subprocess pipes were not created")
            pumps = [
                _Pump(out_pipe, prefix, self._stdout, self._locks[id(self._stdout)]),
                _Pump(err_pipe, prefix, self._stderr, self._locks[id(self._stderr)]),
            ]
            running = _Running(task, process, pumps)
            self._running.append(running)
            with helper_threads_block_signals():  # Ctrl-C must reach the main thread (unison._launch.interrupts)
                for pump in pumps:
                    pump.start()
                name = f"unison-watch-{prefix}"
                threading.Thread(target=self._watch, args=(running,), name=name, daemon=True).start()

    def _watch(self, running: _Running) -> None:
        running.process.wait()
        self._exits.put(running)

    def wait(self, stop_when: Callable[[], bool] | None = None) -> Outcome:
        """Waits until every task succeeded or one failed; stops the rest either way.

        ps tasks that still run once every other task succeeded are stopped; that is
        success. In a parameter-server job (a chief and ps tasks) the chief is the
        coordinator: its shutdown tells the ps tasks to stop, so they get the grace period
        to exit by themselves first; a worker that dies does not end the cluster (the
        coordinator re-runs its functions elsewhere), and once the chief succeeded the
        remaining tasks get the grace period too. Without a chief (the hybrid strategy's
        workers and ps tasks) nothing tells a ps task to stop: on one node it is stopped at
        once (waiting the grace period only delayed the job's end); with other nodes
        (``stop_when``) their tasks may still use it, and it gets the grace period.
        ``stop_when``, if given, is called every 0.2 s while tasks run; when it returns True
        every task is stopped and the outcome says ``stopped`` (multi-node launch: a task on
        another node failed).
        """
        pending = {id(r): r for r in self._running}
        types = {r.task.type for r in self._running}
        ps_job = "ps" in types and "chief" in types
        ps_deadline = None
        try:
            while pending:
                if stop_when is not None and not all(r.task.type == "ps" for r in pending.values()):
                    try:
                        running = self._exits.get(timeout=0.2)
                    except queue.Empty:
                        if stop_when():
                            self._let_settle(pending)
                            return Outcome(stopped=True)
                        continue
                    self._exits.put(running)  # handled below, with the ps rules
                chief_done = ps_job and all(r.task.type != "chief" for r in pending.values())
                if chief_done or all(r.task.type == "ps" for r in pending.values()):
                    if ps_deadline is None:
                        let_ps_exit = ps_job or stop_when is not None  # told by the chief, or other nodes
                        ps_deadline = time.monotonic() + (self._grace if let_ps_exit else 0.0)
                    try:
                        running = self._exits.get(timeout=max(0.0, ps_deadline - time.monotonic()))
                    except queue.Empty:
                        break  # the ps tasks were not told to stop: stop them below
                else:
                    running = self._next_exit()
                pending.pop(id(running), None)
                code = running.process.returncode
                if code != 0 and ps_job and running.task.type == "worker":
                    self._drain(running)
                    self.message(f"{running.task.name} exited with code {code}; the cluster goes on "
                                 f"(the coordinator re-runs its functions on other workers)")
                    continue
                if code != 0:
                    self._let_settle(pending)
                    self._drain(running)
                    return Outcome(running.task, code, notified=self.preemption_notices())
            return Outcome()
        finally:
            self.stop()

    def _next_exit(self) -> _Running:
        """The next task to end. Waits in slices, running any signal handler left pending meanwhile
        (``unison._launch.interrupts``): one long wait would sleep through a Ctrl-C."""
        while True:
            try:
                return self._exits.get(timeout=SIGNAL_POLL_S)
            except queue.Empty:
                continue

    def preemption_notices(self) -> tuple[str, ...]:
        """The tasks that have received a preemption signal so far, by name, sorted."""
        if self._notices is None:
            return ()
        names = []
        try:
            entries = sorted(os.scandir(self._notices), key=lambda entry: entry.name)
        except OSError:
            return ()
        for entry in entries:
            try:
                with open(entry.path, encoding="utf-8") as f:
                    names.append(f.read().split()[0])
            except (OSError, IndexError):
                continue  # being written: its task is still in its signal handler
        return tuple(names)

    def _let_settle(self, pending: dict[int, _Running]) -> None:
        deadline = time.monotonic() + self._settle
        while pending and (left := deadline - time.monotonic()) > 0:
            try:
                pending.pop(id(self._exits.get(timeout=left)), None)
            except queue.Empty:
                break

    def _drain(self, running: _Running) -> None:
        _join_pumps(running)

    def stop(self) -> None:
        """SIGTERM to every task's process group, SIGKILL to what remains after the grace period."""
        groups = [r.process.pid for r in self._running]
        for pgid in groups:
            _signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + self._grace
        for r in self._running:
            try:
                r.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        while any(_group_alive(pgid) for pgid in groups) and time.monotonic() < deadline:
            time.sleep(0.05)  # grandchildren are not ours to wait on; poll their group
        for pgid in groups:
            if _group_alive(pgid):
                _signal_group(pgid, signal.SIGKILL)
        for r in self._running:
            r.process.wait()
            _join_pumps(r)
        if self._notices is not None:
            shutil.rmtree(self._notices, ignore_errors=True)
            self._notices = None


def _join_pumps(running: _Running) -> None:
    """Waits (briefly) for a task's output pumps to pass on what is left.

    A pump not started yet is skipped: a SIGTERM to the launcher raises in ``start()``
    between recording a task and starting its pumps, and the stop that follows must
    still end every task instead of failing on ``join``.
    """
    for pump in running.pumps:
        if pump.ident is not None:
            pump.join(timeout=1.0)


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass
