"""INDEPENDENT_WORKER mode: every task runs the coordinator, started by `unison launch`."""

import json
import os
from pathlib import Path

import pytest
from _coordinator_procs import Processes

from unison._launch.cli import main
from unison._launch.procs import reserve_ports

HERE = Path(__file__).resolve().parent

SCRIPT = """
import json, os, sys, time
from pathlib import Path
sys.path.insert(0, {helpers!r})
from _coordinator_fakes import FakeStrategy
from unison.coordinator import get_current_worker_context, run_distribute_coordinator

out = Path(sys.argv[1])


def worker_fn(strategy):
    context = get_current_worker_context()
    arrived = out / "slow-worker-arrived"
    if context.task_id == 1:  # the slow worker
        time.sleep(0.5)
        arrived.write_text("1")
    context.wait_for_other_workers()
    passed_after_slow = arrived.exists()
    context.wait_for_other_workers()  # the barrier is reusable
    return {{
        "task": [context.task_type, context.task_id],
        "pid": os.getpid(),
        "chief": context.is_chief,
        "workers": context.num_workers,
        "passed_after_slow": passed_after_slow,
        "configured": strategy.configured,
        "should_checkpoint": context.should_checkpoint,
        "target": context.master_target,
    }}


def eval_fn(strategy):
    context = get_current_worker_context()
    return {{"task": [context.task_type, context.task_id], "distributed": context.distributed_mode,
             "chief": context.is_chief, "strategy": strategy is None}}


result = run_distribute_coordinator(worker_fn, FakeStrategy(), eval_fn=eval_fn, mode="independent_worker")
task = json.loads(os.environ["TF_CONFIG"])["task"]
(out / "{{}}-{{}}.json".format(task["type"], task["index"])).write_text(json.dumps(result))
print("done", task["type"], task["index"])
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT.format(helpers=str(HERE)))
    return path


def _read(out, name):
    return json.loads((out / f"{name}.json").read_text())


@pytest.mark.timeout(120)
def test_two_workers_and_an_evaluator(script, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    code = main(["launch", "--workers", "2", "--evaluator", "--grace-period", "2", str(script), str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    worker0, worker1, evaluator = _read(out, "worker-0"), _read(out, "worker-1"), _read(out, "evaluator-0")
    cluster = worker0["configured"][0]
    assert sorted(cluster) == ["evaluator", "worker"] and len(cluster["worker"]) == 2
    assert worker0["configured"] == [cluster, "worker", 0] and worker1["configured"] == [cluster, "worker", 1]
    assert (worker0["chief"], worker1["chief"]) == (True, False)
    assert (worker0["should_checkpoint"], worker1["should_checkpoint"]) == (True, False)
    assert worker0["workers"] == worker1["workers"] == 2
    # The barrier held the fast worker until the slow one had arrived.
    assert worker0["passed_after_slow"] and worker1["passed_after_slow"]
    assert worker0["pid"] != worker1["pid"]
    assert worker1["target"] == f"tcp://{cluster['worker'][1]}"
    assert evaluator == {"task": ["evaluator", 0], "distributed": False, "chief": True, "strategy": True}
    for name in ("worker:0", "worker:1", "evaluator:0"):
        assert f"[{name}] done {name.replace(':', ' ')}" in captured.out


@pytest.mark.timeout(120)
def test_ps_serves_until_the_chief_tells_it_to_stop(script, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    # A long grace period: had the ps not been told to stop, the launcher would kill it
    # and it would never write its result file.
    code = main(["launch", "--chief", "--workers", "0", "--ps", "1", "--grace-period", "30", str(script), str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    chief = _read(out, "chief-0")
    assert chief["task"] == ["chief", 0] and chief["chief"] and chief["workers"] == 1
    assert _read(out, "ps-0") is None  # returned after being stopped
    assert "[ps:0] done ps 0" in captured.out


FAILING_SCRIPT = """
import json, os, sys
from pathlib import Path
sys.path.insert(0, {helpers!r})
from _coordinator_fakes import FakeStrategy
from unison.coordinator import get_current_worker_context, run_distribute_coordinator

out = Path(sys.argv[1])


def worker_fn(strategy):
    context = get_current_worker_context()
    if context.task_id == 1:
        raise RuntimeError("worker 1 gave up")
    context.wait_for_other_workers()  # worker 1 never arrives


task = json.loads(os.environ["TF_CONFIG"])["task"]
try:
    run_distribute_coordinator(worker_fn, FakeStrategy(), mode="independent_worker")
except Exception as e:
    (out / "worker-{{}}.error".format(task["index"])).write_text("{{}}: {{}}".format(type(e).__name__, e))
    sys.exit(1)
"""


@pytest.mark.timeout(120)
def test_a_failed_worker_releases_the_others_waiting_at_the_barrier(tmp_path):
    """Without a launcher to kill the cluster, the failure travels through the store."""
    script = tmp_path / "failing.py"
    script.write_text(FAILING_SCRIPT.format(helpers=str(HERE)))
    out = tmp_path / "out"
    out.mkdir()
    worker0, worker1, store = reserve_ports(3)
    cluster = {"worker": [f"127.0.0.1:{worker0}", f"127.0.0.1:{worker1}"]}
    processes = Processes()
    try:
        started = []
        for index in range(2):
            tf_config = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})
            env = dict(os.environ, TF_CONFIG=tf_config, UNISON_COORDINATOR_PORT=str(store))
            started.append(processes.python(script, env=env, args=[str(out)]))
        assert [p.wait(timeout=60) for p in started] == [1, 1]
    finally:
        processes.close()
    assert (out / "worker-1.error").read_text() == "RuntimeError: worker 1 gave up"
    assert (out / "worker-0.error").read_text() == "ClusterError: stopped worker barrier #1: task worker:1 failed"
