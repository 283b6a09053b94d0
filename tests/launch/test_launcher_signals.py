"""A Ctrl-C reaches the launcher's main thread, which stops every task, and a server's join
(``unison._launch.interrupts``).

The kernel hands a signal sent to a process to any thread that does not block it; Python runs
the handler in the main thread only, when that thread runs Python code. A Ctrl-C that a pump
thread took left the launcher asleep in its wait until a task ended.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

from unison._launch.interrupts import LAUNCHER_SIGNALS
from unison._launch.procs import LocalCluster, cluster_environments, plan_tasks

pytestmark = pytest.mark.skipif(not hasattr(signal, "pthread_sigmask") or not os.path.isdir("/proc/self/task"),
                                reason="needs POSIX thread signal masks and /proc")

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]
SHOW_MASKS = "print(*(l.strip() for l in open('/proc/self/status') if l.startswith(('SigBlk', 'SigIgn'))), flush=True)"


def _run_to_end(script: str) -> subprocess.CompletedProcess:
    """Runs ``script`` (which prints its signal masks first); one still running after 30 s fails the test
    with its output and both processes' masks (an inherited ignored or blocked SIGINT would hang it)."""
    child = subprocess.Popen([sys.executable, "-c", SHOW_MASKS + "\n" + script], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = child.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        child.kill()
        stdout, stderr = child.communicate()
        pytest.fail(f"still running 30 s after the signal; its output: {stdout} {stderr[-2000:]}; this test "
                    f"process blocks {sorted(signal.pthread_sigmask(signal.SIG_BLOCK, []))} and its SIGINT handler "
                    f"is {signal.getsignal(signal.SIGINT)}")
    return subprocess.CompletedProcess(child.args, child.returncode, stdout, stderr)


def _blocked(status_path: str) -> set[int]:
    """The signals a thread or process blocks, from its /proc status."""
    with open(status_path) as f:
        mask = int(next(line for line in f if line.startswith("SigBlk:")).split()[1], 16)
    return {n for n in range(1, 65) if mask >> (n - 1) & 1}


@pytest.mark.timeout(60)
def test_the_launchers_helper_threads_block_its_signals_and_its_tasks_and_main_thread_do_not():
    main_before = _blocked(f"/proc/self/task/{threading.get_native_id()}/status")
    environments = cluster_environments(plan_tasks(2), authkey=os.urandom(32), restart=0, base=dict(os.environ))
    cluster = LocalCluster(SLEEPER, environments, grace_period=1, stdout=sys.stdout, stderr=sys.stderr)
    try:
        cluster.start()
        helpers = [t for t in threading.enumerate() if t.name.startswith(("unison-pump-", "unison-watch-"))]
        assert len(helpers) == 6  # two pumps and a watcher a task
        for thread in helpers:
            assert set(LAUNCHER_SIGNALS) <= _blocked(f"/proc/self/task/{thread.native_id}/status"), thread.name
        assert _blocked(f"/proc/self/task/{threading.get_native_id()}/status") == main_before
        for running in cluster._running:  # a task starts with no signal blocked: SIGTERM must still stop it
            assert not set(LAUNCHER_SIGNALS) & _blocked(f"/proc/{running.process.pid}/status")
    finally:
        cluster.stop()


@pytest.mark.timeout(60)
def test_a_ctrl_c_another_thread_took_still_stops_every_task(sigint_as_in_a_terminal):
    # A thread that blocks nothing (as a library's C thread) takes the SIGINT while the main thread waits
    # for the tasks (which would sleep 60 s): the wait must wake up to run the handler.
    script = textwrap.dedent(f"""
        import os, signal, sys, threading, time
        from unison._launch.one_run import run_once
        from unison._launch.procs import LocalCluster, cluster_environments, plan_tasks
        environments = cluster_environments(plan_tasks(2), authkey=os.urandom(32), restart=0, base=dict(os.environ))
        cluster = LocalCluster({SLEEPER!r}, environments, grace_period=1, stdout=sys.stdout, stderr=sys.stderr)

        def take_the_signal():
            time.sleep(1.0)
            signal.pthread_kill(threading.get_ident(), signal.SIGINT)  # to this thread only
            time.sleep(60)

        threading.Thread(target=take_the_signal, daemon=True).start()
        code = run_once(cluster)
        print("exit", code, "tasks alive", sum(r.process.poll() is None for r in cluster._running))
    """)
    done = _run_to_end(script)
    assert done.returncode == 0, done.stderr
    assert "exit 130 tasks alive 0" in done.stdout, done.stdout + done.stderr
    assert "interrupted by SIGINT; stopped every task" in done.stderr


@pytest.mark.timeout(60)
def test_a_ctrl_c_one_of_a_servers_threads_took_still_interrupts_its_join(sigint_as_in_a_terminal):
    # `unison server` and a ps task's process wait in Server.join: the same sleep through a Ctrl-C
    script = textwrap.dedent("""
        import signal, threading, time
        import unison
        from unison._coordinator.channel import generate_authkey
        server = unison.Server({"ps": ["127.0.0.1:1"]}, "ps", 0, authkey=generate_authkey(),
                               bind_address="127.0.0.1:0")

        def take_the_signal():
            time.sleep(1.0)
            signal.pthread_kill(threading.get_ident(), signal.SIGINT)
            time.sleep(60)

        threading.Thread(target=take_the_signal, daemon=True).start()
        try:
            server.join()
        except KeyboardInterrupt:
            print("interrupted")
        server.stop()
    """)
    done = _run_to_end(script)
    assert "interrupted" in done.stdout, done.stdout + done.stderr
