"""`unison launch`: local clusters of real processes, failures, restarts, interrupts."""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from importlib.metadata import entry_points

import pytest

from unison._launch.cli import main
from unison._launch.interrupts import Interrupted
from unison._launch.procs import Task, plan_tasks

# Shared by the scripts below: who am I, and where do I write.
PRELUDE = """
import json, os, signal, subprocess, sys, time
from pathlib import Path
TASK = json.loads(os.environ["TF_CONFIG"])["task"]
NAME = "{}:{}".format(TASK["type"], TASK["index"])
OUT = Path(sys.argv[1])


def wait_for(path):
    while not path.exists():
        time.sleep(0.01)
"""


def alive(pid):
    """Whether ``pid`` is a running (non-zombie) process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] != b"Z"
    except FileNotFoundError:
        return False


@pytest.fixture
def write_script(tmp_path):
    def write(body):
        path = tmp_path / "script.py"
        path.write_text(PRELUDE + textwrap.dedent(body))
        return path

    return write


@pytest.fixture
def out(tmp_path):
    path = tmp_path / "out"
    path.mkdir()
    return path


@pytest.fixture
def no_omp(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)


ENV_REPORT = """
    keys = ["TF_CONFIG", "UNISON_AUTHKEY", "UNISON_COORDINATOR_PORT", "OMP_NUM_THREADS", "PYTHONUNBUFFERED",
            "UNISON_RESTART_COUNT"]
    (OUT / (NAME + ".json")).write_text(json.dumps({"env": {k: os.environ.get(k) for k in keys}, "argv": sys.argv[2:]}))
    print("I am", NAME)
    print("a warning from", NAME, file=sys.stderr)
"""


@pytest.mark.timeout(60)
def test_two_workers_print_their_task(write_script, out, capsys, no_omp):
    script = write_script("if True:" + ENV_REPORT)
    assert main(["launch", "--workers", "2", str(script), str(out), "--lr", "0.1"]) == 0
    captured = capsys.readouterr()
    assert "[worker:0] I am worker:0\n" in captured.out and "[worker:1] I am worker:1\n" in captured.out
    assert "[worker:1] a warning from worker:1\n" in captured.err
    reports = [json.loads((out / f"worker:{i}.json").read_text()) for i in range(2)]
    configs = [json.loads(r["env"]["TF_CONFIG"]) for r in reports]
    assert [c["task"] for c in configs] == [{"type": "worker", "index": 0}, {"type": "worker", "index": 1}]
    cluster = configs[0]["cluster"]
    assert configs[1]["cluster"] == cluster and list(cluster) == ["worker"]
    hosts_ports = [address.split(":") for address in cluster["worker"]]
    assert all(host == "127.0.0.1" for host, _ in hosts_ports)
    ports = {int(port) for _, port in hosts_ports} | {int(reports[0]["env"]["UNISON_COORDINATOR_PORT"])}
    assert len(ports) == 3  # every task and the coordination store on its own port
    keys = {r["env"]["UNISON_AUTHKEY"] for r in reports}
    assert len(keys) == 1 and len(bytes.fromhex(keys.pop())) == 32
    assert all(r["env"]["OMP_NUM_THREADS"] == "1" and r["env"]["PYTHONUNBUFFERED"] == "1" for r in reports)
    assert all(r["env"]["UNISON_RESTART_COUNT"] == "0" and r["argv"] == ["--lr", "0.1"] for r in reports)


@pytest.mark.timeout(60)
def test_ps_in_workers_starts_no_ps_process_and_tells_the_workers(write_script, out, capsys):
    script = write_script("""
        (OUT / (NAME + ".json")).write_text(json.dumps({k: os.environ.get(k) for k in ["TF_CONFIG",
                                                                                       "UNISON_PS_IN_WORKERS"]}))
    """)
    assert main(["launch", "--workers", "2", "--ps", "3", "--ps-in-workers", str(script), str(out)]) == 0
    capsys.readouterr()
    assert sorted(p.name for p in out.iterdir()) == ["worker:0.json", "worker:1.json"]
    reports = [json.loads((out / f"worker:{i}.json").read_text()) for i in range(2)]
    assert all(r["UNISON_PS_IN_WORKERS"] == "1" for r in reports)
    assert len(json.loads(reports[0]["TF_CONFIG"])["cluster"]["ps"]) == 3  # their addresses, served by the workers


@pytest.mark.timeout(60)
def test_roles_and_the_users_thread_setting(write_script, out, monkeypatch, capsys):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    script = write_script("if True:" + ENV_REPORT)
    assert main(["launch", "--chief", "--workers", "1", "--evaluator", str(script), str(out)]) == 0
    capsys.readouterr()
    report = json.loads((out / "chief:0.json").read_text())
    assert report["env"]["OMP_NUM_THREADS"] == "3"
    assert sorted(json.loads(report["env"]["TF_CONFIG"])["cluster"]) == ["chief", "evaluator", "worker"]
    assert sorted(p.name for p in out.iterdir()) == ["chief:0.json", "evaluator:0.json", "worker:0.json"]


@pytest.mark.timeout(60)
def test_a_failing_worker_stops_the_cluster_and_is_named(write_script, out, capsys):
    script = write_script(
        """
        if NAME == "worker:0":
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            (OUT / "pids").write_text(json.dumps([os.getpid(), child.pid]))
            time.sleep(60)
        else:
            wait_for(OUT / "pids")
            print("failing now")
            sys.exit(3)
        """
    )
    start = time.monotonic()
    code = main(["launch", "--workers", "2", "--grace-period", "2", str(script), str(out)])
    elapsed = time.monotonic() - start
    captured = capsys.readouterr()
    assert code == 3
    assert elapsed < 10, elapsed
    assert "[worker:1] failing now" in captured.out
    assert "unison launch: task worker:1 exited with code 3; stopped the other 1 task(s)" in captured.err
    assert "unison launch: cluster failed: task worker:1 exited with code 3" in captured.err
    worker0, grandchild = json.loads((out / "pids").read_text())
    assert not alive(worker0) and not alive(grandchild)  # the whole process group is gone


@pytest.mark.timeout(60)
def test_a_preemption_names_the_task_that_got_the_notice_not_the_first_to_exit(write_script, out, capsys):
    """worker:1 got the SIGTERM, worker:0 left first with code 75: the launcher said `task worker:0 was preempted`."""
    script = write_script(
        """
        if NAME == "worker:1":  # names itself as PreemptionCheckpointHandler does on the signal, then saves slowly
            Path(os.environ["UNISON_PREEMPTION_NOTICES"], "worker-1").write_text("worker:1 SIGTERM\\n")
            (OUT / "noticed").write_text("")
            time.sleep(30)
        wait_for(OUT / "noticed")
        sys.exit(75)
        """
    )
    code = main(["launch", "--workers", "2", "--grace-period", "2", str(script), str(out)])
    err = capsys.readouterr().err
    assert code == 75, err
    assert ("unison launch: the job was preempted (notice to worker:1) and saved at the agreed step; task worker:0 "
            "exited first, with code 75; stopped the other 1 task(s)") in err, err
    assert not [line for line in err.splitlines() if "Traceback" in line], err


@pytest.mark.timeout(60)
def test_a_task_ignoring_sigterm_is_killed_after_the_grace_period(write_script, out, capsys):
    script = write_script(
        """
        if NAME == "worker:0":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            (OUT / "pid").write_text(str(os.getpid()))
            time.sleep(60)
        else:
            wait_for(OUT / "pid")
            os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    start = time.monotonic()
    code = main(["launch", "--workers", "2", "--grace-period", "0.5", str(script), str(out)])
    captured = capsys.readouterr()
    assert code == 128 + signal.SIGKILL
    assert "task worker:1 exited with code 137 (killed by SIGKILL)" in captured.err
    assert time.monotonic() - start < 10
    assert not alive(int((out / "pid").read_text()))


@pytest.mark.timeout(60)
def test_max_restarts_reruns_the_cluster(write_script, out, capsys):
    script = write_script(
        """
        restart = os.environ["UNISON_RESTART_COUNT"]
        with open(OUT / "runs", "a") as f:
            f.write(NAME + " " + restart + "\\n")
        if NAME == "worker:1" and restart == "0":
            sys.exit(3)
        """
    )
    code = main(["launch", "--workers", "2", "--max-restarts", "1", str(script), str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "unison launch: restarting the cluster (restart 1 of 1)" in captured.err
    runs = (out / "runs").read_text().split("\n")
    assert "worker:1 0" in runs and "worker:1 1" in runs and "worker:0 1" in runs


@pytest.mark.timeout(60)
def test_restarts_run_out(write_script, out, capsys):
    script = write_script(
        """
        with open(OUT / "runs", "a") as f:
            f.write(NAME + "\\n")
        if NAME == "worker:1":
            sys.exit(3)
        """
    )
    code = main(["launch", "--workers", "2", "--max-restarts", "1", str(script), str(out)])
    captured = capsys.readouterr()
    assert code == 3
    assert (out / "runs").read_text().split().count("worker:1") == 2
    assert captured.err.count("restarting the cluster") == 1
    assert "cluster failed: task worker:1 exited with code 3" in captured.err


@pytest.mark.timeout(60)
def test_ps_left_running_after_the_workers_succeed_is_stopped(write_script, out, capsys):
    script = write_script(
        """
        if NAME == "ps:0":
            (OUT / "ps-pid").write_text(str(os.getpid()))
            time.sleep(60)
        else:
            wait_for(OUT / "ps-pid")
        """
    )
    start = time.monotonic()
    assert main(["launch", "--workers", "1", "--ps", "1", "--grace-period", "0.5", str(script), str(out)]) == 0
    capsys.readouterr()
    assert time.monotonic() - start < 10
    assert not alive(int((out / "ps-pid").read_text()))


_PS_AND_WHEN_IT_IS_STOPPED = """
    if NAME.startswith("ps"):
        def stopped(signum, frame):
            (OUT / "ps-stopped").write_text(str(time.time()))
            sys.exit(0)
        signal.signal(signal.SIGTERM, stopped)
        (OUT / "ps-started").write_text("")
        time.sleep(60)
    else:
        wait_for(OUT / "ps-started")
        (OUT / (NAME + "-done")).write_text(str(time.time()))
    """


@pytest.mark.timeout(60)
def test_without_a_chief_nothing_tells_the_ps_to_stop_so_the_launcher_stops_it_at_once(write_script, out, capsys):
    """A hybrid job's ps task holds rows until the launcher ends it: waiting the grace period first
    only delayed every such job's end by that much."""
    script = write_script(_PS_AND_WHEN_IT_IS_STOPPED)
    assert main(["launch", "--workers", "2", "--ps", "1", "--grace-period", "30", str(script), str(out)]) == 0
    capsys.readouterr()
    last_worker = max(float((out / f"worker:{i}-done").read_text()) for i in range(2))
    assert float((out / "ps-stopped").read_text()) - last_worker < 10  # not the 30 s grace period


@pytest.mark.timeout(60)
def test_with_a_chief_the_ps_gets_the_grace_period_to_exit_by_itself_first(write_script, out, capsys):
    """The chief's coordinator shuts the ps tasks down; the launcher gives them time to exit."""
    script = write_script(_PS_AND_WHEN_IT_IS_STOPPED)
    assert main(["launch", "--chief", "--workers", "1", "--ps", "1", "--grace-period", "1.5", str(script),
                 str(out)]) == 0
    capsys.readouterr()
    chief_done = float((out / "chief:0-done").read_text())
    assert float((out / "ps-stopped").read_text()) - chief_done >= 1.4


@pytest.mark.timeout(60)
def test_python_m_unison_launch_and_ctrl_c_stops_every_task(write_script, out, sigint_as_in_a_terminal):
    script = write_script(
        """
        print("started", NAME)
        (OUT / NAME).write_text(str(os.getpid()))
        time.sleep(60)
        """
    )
    launcher = subprocess.Popen(
        [sys.executable, "-m", "unison.launch", "--workers", "2", "--grace-period", "2", str(script), str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 45
        while not ((out / "worker:0").exists() and (out / "worker:1").exists()):
            assert launcher.poll() is None and time.monotonic() < deadline, "workers did not start"
            time.sleep(0.02)
        masks = _signal_masks(launcher.pid)  # named if it hangs: an inherited ignored or blocked SIGINT
        launcher.send_signal(signal.SIGINT)
        try:
            stdout, stderr = launcher.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the launcher did not stop within 30 s of SIGINT; its signal masks then: {masks}; "
                        f"the test process's: {_signal_masks(os.getpid())}")
    finally:
        launcher.kill()
        launcher.wait()
    assert launcher.returncode == 130, stderr
    assert "[worker:0] started worker:0" in stdout and "[worker:1] started worker:1" in stdout
    assert "unison launch: interrupted by SIGINT; stopped every task" in stderr
    assert not any(alive(int((out / f"worker:{i}").read_text())) for i in range(2))


def _signal_masks(pid: int) -> dict[str, str]:
    """A process's blocked, ignored and caught signals (/proc), or {} where there is no /proc."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = (line.partition(":") for line in f)
            return {k: v.strip() for k, _, v in fields if k in ("SigBlk", "SigIgn", "SigCgt")}
    except OSError:
        return {}


def test_console_script_is_unison_launch_cli_main():
    (script,) = entry_points(group="console_scripts", name="unison")
    assert script.value == "unison._launch.cli:main"
    assert script.load() is main


def test_plan_tasks():
    assert plan_tasks(2, chief=True, ps=1, evaluator=True) == [
        Task("chief", 0),
        Task("worker", 0),
        Task("worker", 1),
        Task("ps", 0),
        Task("evaluator", 0),
    ]
    assert [t.name for t in plan_tasks(0, chief=True)] == ["chief:0"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["launch", "--workers", "0", "x.py"], "needs a chief or at least one worker"),
        (["launch", "--workers", "-1", "x.py"], "'-1' is not a non-negative integer"),
        (["launch", "--ps", "two", "x.py"], "'two' is not a non-negative integer"),
        (["launch", "--grace-period", "-1", "x.py"], "not a non-negative number of seconds"),
        (["launch", "--workers", "2", "--ps-in-workers", "x.py"], "it needs --ps M >= 1 and --workers N >= 1"),
        (["launch", "--workers", "2", "--ps", "2", "--ps-in-workers", "--max-restarts", "1", "x.py"],
         "a restart would lose them"),
        (["launch", "--nnodes", "2", "--master-addr", "127.0.0.1", "--ps", "1", "--ps-in-workers", "x.py"],
         "--ps-in-workers is for a one-node launch"),
        (["launch"], "the following arguments are required: script"),
        ([], "the following arguments are required: COMMAND"),
    ],
)
def test_command_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_progress_reads_as_clean_prefixed_lines_in_a_log(tmp_path):
    """Captured (a log, a CI job), a task's carriage-return redraws become whole lines with
    one prefix each, and ``unison.progress.track`` writes plain lines, told by the launcher
    that its streams are no terminal (the relay itself: tests/launch/test_task_output.py)."""
    script = tmp_path / "progress.py"
    script.write_text(textwrap.dedent("""
        import os, sys
        from unison.progress import track
        for i in range(3):  # as tqdm(leave=False) draws and then clears its bar
            sys.stderr.write(f'\\rstep {i}/3')
            sys.stderr.flush()
        sys.stderr.write('\\r' + ' ' * 10 + '\\rdone\\n')
        print('UNISON_TERMINAL=' + repr(os.environ['UNISON_TERMINAL']), flush=True)
        for _ in track(range(3), 'loop', interval=3600):
            pass
    """))
    done = subprocess.run([sys.executable, "-m", "unison.launch", "--workers", "1", str(script)],
                          capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "[worker:0] UNISON_TERMINAL=''\n"
    expected = r"\[worker:0\] done\n\[worker:0\] loop: 3/3 in \d+\.\d s \(\S+ it/s\)\n"
    assert re.fullmatch(expected, done.stderr), done.stderr


@pytest.mark.timeout(60)
def test_on_a_terminal_progress_stays_a_live_bar(tmp_path):
    """With the launcher's streams on a terminal (a pty here), its tasks hear so and
    ``unison.progress.track`` draws tqdm's bar, which the launcher redraws in place."""
    import pty

    script = tmp_path / "progress.py"
    script.write_text(textwrap.dedent("""
        import os
        from unison.progress import track
        print('UNISON_TERMINAL=' + repr(os.environ['UNISON_TERMINAL']), flush=True)
        for _ in track(range(3), 'loop', leave=True):
            pass
    """))
    primary, secondary = pty.openpty()
    launcher = subprocess.Popen([sys.executable, "-m", "unison.launch", "--workers", "1", str(script)],
                                stdin=subprocess.DEVNULL, stdout=secondary, stderr=secondary)
    os.close(secondary)
    seen = b""
    try:
        while True:
            try:
                chunk = os.read(primary, 65536)
            except OSError:  # EIO: every writer of the terminal has closed it
                break
            if not chunk:
                break
            seen += chunk
    finally:
        os.close(primary)
        assert launcher.wait(timeout=30) == 0, seen
    text = seen.decode().replace("\r\n", "\n")  # the terminal turns "\n" into "\r\n"
    assert "[worker:0] UNISON_TERMINAL='stdout,stderr'\x1b[K\n" in text, text
    assert re.search(r"\r\[worker:0\] loop: +0%\|.*\x1b\[K\r", text), text  # a bar, redrawn in place
    assert re.search(r"\[worker:0\] loop: 100%\|.*\| 3/3 .*\x1b\[K\n", text), text  # kept: leave=True
    assert "[worker:0] [worker:0]" not in text and "[worker:0] \r" not in text, text


@pytest.mark.timeout(60)
def test_a_one_node_launch_never_imports_torch_in_the_launcher(tmp_path):
    """The launcher only starts, watches and stops processes: without torch it starts in
    a fraction of a second and holds about 200 MB less on every node (multi-node launches
    import torch for their TCPStore rendezvous)."""
    script = tmp_path / "task.py"
    script.write_text("print('task ran')\n")
    code = ("import sys\nfrom unison._launch.cli import launch_main\n"
            f"code = launch_main(['--workers', '2', '--chief', {str(script)!r}])\n"
            "print('launcher imported torch:', 'torch' in sys.modules)\nsys.exit(code)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("task ran") == 3 and "launcher imported torch: False" in done.stdout, done.stdout


@pytest.mark.timeout(60)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_sigkilled_launcher_takes_its_silent_workers_with_it(write_script, out):
    """Workers run in sessions of their own: only the parent-death signal reaches them."""
    script = write_script(
        """
        (OUT / NAME).write_text(str(os.getpid()))
        time.sleep(60)
        """
    )
    launcher = subprocess.Popen(
        [sys.executable, "-m", "unison.launch", "--workers", "2", str(script), str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    pids = []
    try:
        deadline = time.monotonic() + 45
        while not ((out / "worker:0").exists() and (out / "worker:1").exists()):
            assert launcher.poll() is None and time.monotonic() < deadline, "workers did not start"
            time.sleep(0.02)
        pids = [int((out / f"worker:{i}").read_text()) for i in range(2)]
        launcher.kill()
        launcher.wait()
        killed = time.monotonic()
        while any(alive(pid) for pid in pids) and time.monotonic() - killed < 5:
            time.sleep(0.02)
        gone_after = time.monotonic() - killed
        assert not any(alive(pid) for pid in pids), f"workers {pids} outlived their SIGKILLed launcher by 5 s"
        print(f"\nworkers gone {gone_after:.3f} s after the launcher's SIGKILL")
    finally:
        launcher.kill()
        launcher.wait()
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(30)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_task_whose_launcher_died_before_it_started_kills_itself(tmp_path):
    """The launcher can die between fork and prctl: the task then finds another parent."""
    from unison._launch.procs import die_with_launcher

    marker = tmp_path / "ran"
    command = die_with_launcher([sys.executable, "-c", f"open({str(marker)!r}, 'w')"])
    assert subprocess.run(command, timeout=20).returncode == 0 and marker.exists()  # its parent is alive
    marker.unlink()
    command[command.index(str(os.getpid()))] = "1"  # as if the launcher were gone already
    assert subprocess.run(command, timeout=20).returncode == -signal.SIGKILL and not marker.exists()


def test_a_signal_before_a_tasks_output_pumps_start_still_stops_every_task(monkeypatch):
    """SIGTERM can raise in ``LocalCluster.start`` after a task is recorded but before its
    pumps start; the stop that follows must end the task, not fail joining an unstarted pump."""
    import io

    from unison._launch import procs

    def interrupted(self):  # the launcher's SIGTERM handler raising at this very point
        raise Interrupted(signal.SIGTERM)

    monkeypatch.setattr(procs._Pump, "start", interrupted)
    task = Task("worker", 0)
    cluster = procs.LocalCluster([sys.executable, "-c", "import time; time.sleep(60)"], {task: dict(os.environ)},
                                 grace_period=5.0, stdout=io.StringIO(), stderr=io.StringIO())
    with pytest.raises(Interrupted):
        cluster.start()
    started = time.monotonic()
    cluster.stop()
    assert time.monotonic() - started < 5.0  # ended by SIGTERM, not by the grace period's SIGKILL
    (running,) = cluster._running
    assert running.process.returncode == -signal.SIGTERM


def test_run_local_cluster_refuses_ps_in_workers_with_restarts():
    from unison._launch.local_run import run_local_cluster

    with pytest.raises(ValueError, match="a restart would lose them"):
        run_local_cluster(["true"], plan_tasks(1, ps=1), authkey=b"k" * 32, max_restarts=1, ps_in_workers=True)
