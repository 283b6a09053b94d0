"""`unison launch --bind-cores`: each task's process on CPUs of its own, inherited from its start."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from unison._launch.cli import main
from unison._launch.core_binding import _sysfs_topology, describe_plan, plan_cores, started_on

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux's")

MINE = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
needs_two_cpus = pytest.mark.skipif(len(MINE) < 2, reason="binding two tasks needs two CPUs")


def alone(cpu):
    """A machine without hardware threads: each CPU a core of its own, one socket."""
    return 0, frozenset({cpu})


def two_sockets_of_two_cores_of_two_threads(cpu):
    """Linux's numbering: CPUs 0-3 are the cores' first threads, 4-7 their second; 0, 1 (and 4, 5) on socket 0."""
    core = cpu % 4
    return core // 2, frozenset({core, core + 4})


def test_the_cpus_are_split_in_task_order_into_contiguous_runs():
    assert plan_cores(["a", "b"], [0, 1], alone) == {"a": (0,), "b": (1,)}
    assert plan_cores(["a", "b"], [3, 2, 1, 0], alone) == {"a": (0, 1), "b": (2, 3)}
    assert plan_cores(["a", "b", "c"], [0, 1, 2, 3, 4], alone) == {"a": (0, 1), "b": (2, 3), "c": (4,)}
    # an affinity with holes (a cgroup's or taskset's CPUs): the CPUs themselves, in order
    assert plan_cores(["a", "b", "c"], [7, 0, 2, 5], alone) == {"a": (0, 2), "b": (5,), "c": (7,)}
    assert plan_cores([], [0, 1], alone) == {}


def test_tasks_get_whole_physical_cores_on_one_socket_where_there_are_enough():
    machine = two_sockets_of_two_cores_of_two_threads
    # by CPU number alone, a would get 0-3: both sockets, and b the same cores' second threads
    assert plan_cores(["a", "b"], range(8), machine) == {"a": (0, 1, 4, 5), "b": (2, 3, 6, 7)}
    assert plan_cores(["a", "b", "c", "d"], range(8), machine) == {"a": (0, 4), "b": (1, 5), "c": (2, 6),
                                                                   "d": (3, 7)}
    assert plan_cores(["a", "b", "c"], range(8), machine) == {"a": (0, 1, 4, 5), "b": (2, 6), "c": (3, 7)}
    # more tasks than cores: hardware threads, a core's side by side
    assert plan_cores(list("abcdef"), range(8), machine) == {"a": (0, 4), "b": (1, 5), "c": (2,), "d": (6,),
                                                             "e": (3,), "f": (7,)}
    # an affinity that holds one thread of a core: that core counts with the CPU it has
    assert plan_cores(["a", "b"], [0, 4, 1], machine) == {"a": (0, 4), "b": (1,)}


def test_the_machines_topology_comes_from_sysfs_and_an_unreadable_cpu_is_a_core_of_its_own():
    for cpu in MINE:
        socket_id, siblings = _sysfs_topology(cpu)
        assert isinstance(socket_id, int) and cpu in siblings
    assert _sysfs_topology(10**6) == (0, frozenset({10**6}))  # no such CPU: nothing to read


def test_more_tasks_than_cpus_is_refused_naming_both_counts_and_the_fix():
    with pytest.raises(ValueError, match=r"3 tasks would share 2 CPU\(s\) \(this launcher may run on CPUs 0-1\).*"
                                         r"--ps-in-workers.*drop --bind-cores"):
        plan_cores(["a", "b", "c"], [0, 1], alone)


def test_the_plan_reads_as_one_line():
    assert describe_plan({"worker:0": (0,), "worker:1": (1, 2, 3, 5)}) == "worker:0 on CPU 0, worker:1 on CPUs 1-3,5"


@needs_two_cpus
def test_a_process_started_in_the_block_inherits_the_binding_and_the_caller_gets_its_own_back():
    report = [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"]
    with started_on([MINE[1]]):
        assert os.sched_getaffinity(0) == {MINE[1]}
        inside = subprocess.run(report, capture_output=True, text=True, check=True, timeout=60).stdout
    assert sorted(os.sched_getaffinity(0)) == MINE
    assert json.loads(inside) == [MINE[1]]
    with pytest.raises(RuntimeError), started_on([MINE[0]]):
        raise RuntimeError("a failed start")
    assert sorted(os.sched_getaffinity(0)) == MINE
    with started_on(None):
        assert sorted(os.sched_getaffinity(0)) == MINE


REPORT = """
    import json, os, sys, threading, time
    from pathlib import Path
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    name = "{}:{}".format(task["type"], task["index"])
    seen = {}
    worker = threading.Thread(target=lambda: seen.update(thread=sorted(os.sched_getaffinity(0))))
    worker.start(); worker.join()
    out = Path(sys.argv[1])
    (out / (name + ".json")).write_text(json.dumps({"main": sorted(os.sched_getaffinity(0)), **seen}))
    if task["type"] == "ps":
        while True:  # a ps task serves until the launcher stops it
            time.sleep(0.1)
    ps_processes = "ps" in json.loads(os.environ["TF_CONFIG"])["cluster"] and not os.environ.get("UNISON_PS_IN_WORKERS")
    while ps_processes and not (out / "ps:0.json").exists():
        time.sleep(0.01)
"""


def _reports(out):
    return {path.stem: json.loads(path.read_text()) for path in out.glob("*.json")}


def _check_disjoint_cover(reports, order):
    """Each task's threads on its own CPUs, the tasks' CPUs in task order and covering the launcher's."""
    cpus = [reports[name]["main"] for name in order]
    for name in order:
        assert reports[name]["thread"] == reports[name]["main"], name  # a thread it starts inherits the binding
    assert all(cpus) and sorted(c for part in cpus for c in part) == MINE
    assert [part[0] for part in cpus] == sorted(part[0] for part in cpus)  # task order


@needs_two_cpus
@pytest.mark.timeout(120)
def test_bound_workers_each_run_on_their_own_cpus_from_the_start(tmp_path, capsys):
    script = tmp_path / "report.py"
    script.write_text(textwrap.dedent(REPORT))
    out = tmp_path / "out"
    out.mkdir()
    assert main(["launch", "--workers", "2", "--ps", "2", "--ps-in-workers", "--bind-cores", str(script),
                 str(out)]) == 0
    reports = _reports(out)
    assert sorted(reports) == ["worker:0", "worker:1"]  # the ps tasks are served in the workers
    _check_disjoint_cover(reports, ["worker:0", "worker:1"])
    err = capsys.readouterr().err
    assert f"unison launch: bound {describe_plan({n: reports[n]['main'] for n in ['worker:0', 'worker:1']})}" in err
    assert sorted(os.sched_getaffinity(0)) == MINE  # the launcher's own thread got its CPUs back


@needs_two_cpus
@pytest.mark.timeout(120)
def test_a_kept_ps_task_and_the_workers_restarted_beside_it_keep_their_own_cpus(tmp_path, capsys):
    script = tmp_path / "report.py"
    script.write_text(textwrap.dedent(REPORT) + textwrap.dedent("""
        if task["type"] == "worker" and os.environ["UNISON_RESTART_COUNT"] == "0":
            sys.exit(3)  # the first run fails: the workers restart, the ps task keeps running
    """))
    out = tmp_path / "out"
    out.mkdir()
    assert main(["launch", "--workers", "1", "--ps", "1", "--max-restarts", "1", "--bind-cores", str(script),
                 str(out)]) == 0
    reports = _reports(out)
    _check_disjoint_cover(reports, ["worker:0", "ps:0"])
    assert "restarting the workers" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_launch_refuses_more_tasks_than_cpus_before_starting_any(tmp_path, capsys):
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('started')\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["launch", "--workers", str(len(MINE) + 1), "--bind-cores", str(script)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"{len(MINE) + 1} tasks would share {len(MINE)} CPU(s)" in err and "started" not in err


@pytest.mark.timeout(60)
def test_a_multi_node_launch_refuses_more_tasks_a_node_than_cpus_before_its_rendezvous(tmp_path, capsys):
    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('started')\n")
    with pytest.raises(SystemExit) as exit_info:  # no master listens: reaching the rendezvous would hang 300 s
        main(["launch", "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1", "--workers-per-node",
              str(len(MINE) + 1), "--bind-cores", str(script)])
    assert exit_info.value.code == 2
    assert f"{len(MINE) + 1} tasks would share {len(MINE)} CPU(s)" in capsys.readouterr().err
