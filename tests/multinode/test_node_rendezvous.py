"""The launchers' rendezvous: missing nodes, mismatched flags, restarts of every node, flag checks."""

from __future__ import annotations

import json
import signal
import sys
import textwrap
import time

import pytest

from unison._launch.cli import main
from unison._launch.multinode import job_cluster, plan_node
from unison._launch.node_address import address_toward, interface_of
from unison._launch.node_rendezvous import NodeTasks

# Records each task's TF_CONFIG and restart count; worker:3 fails in the first generation.
SCRIPT = """
import json, os, sys
from pathlib import Path
config = json.loads(os.environ["TF_CONFIG"])
name = "{}:{}".format(config["task"]["type"], config["task"]["index"])
restart = os.environ["UNISON_RESTART_COUNT"]
Path(sys.argv[1], f"{name}.{restart}.json").write_text(json.dumps(
    {"cluster": config["cluster"], "rendezvous": os.environ.get("UNISON_RENDEZVOUS"),
     "ifname": os.environ.get("GLOO_SOCKET_IFNAME"), "key": os.environ["UNISON_AUTHKEY"]}))
if name == "worker:3" and restart == "0" and "fail-worker-3" in sys.argv:
    sys.exit(3)
print(name, "ran restart", restart)
"""


def launcher(hosts, rank, script, *args, nnodes=2, timeout=30, extra=()):
    command = [
        sys.executable, "-m", "unison.launch", "--nnodes", str(nnodes), "--node-rank", str(rank),
        "--master-addr", hosts.address(0), "--workers-per-node", "2", "--rendezvous-timeout", str(timeout),
        "--grace-period", "1", *extra, str(script), *args,
    ]  # fmt: skip
    return hosts.popen(rank, command)


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(SCRIPT))
    (tmp_path / "out").mkdir()
    return path


@pytest.mark.timeout(120)
def test_every_node_restarts_together_with_a_fresh_rendezvous(simulated_hosts, script, tmp_path):
    hosts = simulated_hosts(2)
    out = tmp_path / "out"
    procs = [launcher(hosts, r, script, str(out), "fail-worker-3", extra=("--max-restarts", "1")) for r in range(2)]
    outputs = [p.communicate(timeout=90)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    for output in outputs:
        assert "task worker:3 on node 1 exited with code 3" in output
        assert "restarting the job on every node (restart 1 of 1)" in output
    assert "[worker:0] worker:0 ran restart 1" in outputs[0] and "[worker:3] worker:3 ran restart 1" in outputs[1]
    first, second = (json.loads((out / f"worker:0.{g}.json").read_text()) for g in (0, 1))
    for g in (0, 1):
        seen = [json.loads((out / f"worker:{i}.{g}.json").read_text()) for i in range(4)]
        assert all(s == seen[0] for s in seen)  # every task of every node got the same cluster and key
        assert (seen[0]["cluster"]["worker"][0].startswith("10.201.0.1:")
                and seen[0]["cluster"]["worker"][3].startswith("10.201.0.2:"))
        assert seen[0]["ifname"] == "eth0" and seen[0]["rendezvous"].startswith("10.201.0.1:")
    assert first["key"] != second["key"]  # each generation has its own key


@pytest.mark.timeout(60)
def test_a_node_that_never_arrives_is_named_within_the_rendezvous_timeout(simulated_hosts, script, tmp_path):
    # A 1 s rendezvous timeout: a node 1 that never comes is named after 1 s, and node 1's attempts to
    # reach a master that never comes (TCPStore retries once, after a backoff) end after about 3.
    hosts = simulated_hosts(2)
    started = time.monotonic()
    alone = launcher(hosts, 0, script, str(tmp_path / "out"), timeout=1)
    output = alone.communicate(timeout=30)[0]
    assert alone.returncode == 1
    assert time.monotonic() - started < 20
    assert "node 1 never arrived" in output and "10.201.0.1:29500" in output, output
    # A node whose master never comes: named master address, within the timeout too.
    started = time.monotonic()
    orphan = launcher(hosts, 1, script, str(tmp_path / "out"), timeout=1)
    output = orphan.communicate(timeout=30)[0]
    assert orphan.returncode == 1 and time.monotonic() - started < 20
    assert "node 1 could not reach the rendezvous store at 10.201.0.1:29500" in output, output


@pytest.mark.timeout(60)
def test_nodes_started_with_different_flags_are_refused(simulated_hosts, script, tmp_path):
    hosts = simulated_hosts(2)
    first = launcher(hosts, 0, script, str(tmp_path / "out"), timeout=5)
    command = [
        sys.executable, "-m", "unison.launch", "--nnodes", "2", "--node-rank", "1", "--master-addr", hosts.address(0),
        "--workers-per-node", "3", "--rendezvous-timeout", "5", str(script), str(tmp_path / "out"),
    ]  # fmt: skip
    second = hosts.popen(1, command)
    outputs = [p.communicate(timeout=30)[0] for p in (first, second)]
    assert second.returncode == 1 and first.returncode == 1
    assert "node 1 was started with --workers-per-node=3 but node 0 with --workers-per-node=2" in outputs[1], outputs


@pytest.mark.timeout(90)
def test_chief_ps_and_evaluator_run_on_node_0(simulated_hosts, script, tmp_path):
    hosts = simulated_hosts(2)
    out = tmp_path / "out"
    flags = ("--chief", "--ps", "1", "--evaluator")
    procs = [launcher(hosts, r, script, str(out), extra=flags) for r in range(2)]
    outputs = [p.communicate(timeout=60)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    for name in ("chief:0", "worker:0", "worker:1", "evaluator:0"):
        assert f"[{name}] {name} ran restart 0" in outputs[0]
    assert "[worker:2] worker:2 ran restart 0" in outputs[1] and "chief" not in outputs[1]
    cluster = json.loads((out / "worker:3.0.json").read_text())["cluster"]
    assert [len(cluster[job]) for job in ("chief", "worker", "ps", "evaluator")] == [1, 4, 1, 1]
    assert cluster["chief"][0].startswith("10.201.0.1:") and cluster["ps"][0].startswith("10.201.0.1:")
    # A node started without them is refused, naming the difference.
    procs = [launcher(hosts, 0, script, str(out), timeout=5, extra=flags),
             launcher(hosts, 1, script, str(out), timeout=5)]
    outputs = [p.communicate(timeout=60)[0] for p in procs]
    assert procs[1].returncode == 1
    assert "node 1 was started with --chief/--ps/--evaluator=[]" in outputs[1], outputs[1]


def test_node_plan_puts_workers_by_node_rank_and_the_other_jobs_on_node_0():
    assert [t.name for t in plan_node(3, 1, 2).tasks] == ["worker:2", "worker:3"]
    node0 = plan_node(2, 0, 2, chief=True, ps=1, evaluator=True)
    assert [t.name for t in node0.tasks] == ["chief:0", "worker:0", "worker:1", "ps:0", "evaluator:0"]
    with pytest.raises(ValueError, match=r"--node-rank 2 is not in 0\.\.1"):
        plan_node(2, 2, 2)
    with pytest.raises(ValueError, match="--workers-per-node K"):
        plan_node(2, 0, 0)
    nodes = [
        NodeTasks(0, "10.0.0.1", (("chief", 0, 5), ("worker", 0, 6), ("ps", 0, 7)), coordinator_port=8),
        NodeTasks(1, "10.0.0.2", (("worker", 1, 6),)),
    ]
    assert job_cluster(nodes) == {"chief": ["10.0.0.1:5"], "worker": ["10.0.0.1:6", "10.0.0.2:6"], "ps": ["10.0.0.1:7"]}
    assert NodeTasks.from_json(nodes[0].to_json()) == nodes[0]


def test_node_address_is_the_one_toward_the_master():
    assert address_toward("127.0.0.1", 29500) == "127.0.0.1"
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("not an address") is None
    with pytest.raises(ValueError, match="--master-addr 'no-such-host.invalid' cannot be resolved"):
        address_toward("no-such-host.invalid", 29500)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--nnodes", "2", "s.py"], "--nnodes 2 needs --master-addr HOST"),
        (["--nnodes", "2", "--master-addr", "h", "--workers", "2", "s.py"], "pass --workers-per-node K instead"),
        (["--workers-per-node", "2", "s.py"], "--workers-per-node and --node-rank are multi-node flags"),
        (["--nnodes", "2", "--master-addr", "h", "--node-rank", "5", "s.py"], "--node-rank 5 is not in 0..1"),
        (["--nnodes", "0", "s.py"], "'0' is not a positive integer"),
        (["--nnodes", "2", "--master-addr", "h", "--master-port", "70000", "s.py"], "'70000' is not a port"),
    ],
)
def test_bad_multinode_flags_are_refused_with_the_fix(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["launch", *argv])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


# Runs until stopped, after saying it started.
FOREVER = """
import json, os, sys, time
from pathlib import Path
config = json.loads(os.environ["TF_CONFIG"])
name = "{}:{}".format(config["task"]["type"], config["task"]["index"])
Path(sys.argv[1], name).write_text(str(os.getpid()))
while True:
    time.sleep(0.05)
"""


def wait_for_files(paths, processes, limit=60):
    deadline = time.monotonic() + limit
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline and all(p.poll() is None for p in processes)
        time.sleep(0.05)


@pytest.mark.timeout(90)
def test_a_launcher_stopped_by_sigterm_ends_the_job_on_every_node(simulated_hosts, tmp_path):
    hosts = simulated_hosts(2)
    script = tmp_path / "forever.py"
    script.write_text(textwrap.dedent(FOREVER))
    out = tmp_path / "out"
    out.mkdir()
    procs = [launcher(hosts, r, script, str(out)) for r in range(2)]
    wait_for_files([out / f"worker:{i}" for i in range(4)], procs)
    # The launcher runs under `ip netns exec ... sh -c ... exec python`: the same pid.
    procs[1].send_signal(signal.SIGTERM)
    outputs = [p.communicate(timeout=60)[0] for p in procs]
    assert [p.returncode for p in procs] == [143, 143], outputs
    assert "job failed: node 1 (its launcher) was interrupted by SIGTERM" in outputs[0], outputs[0]
    assert hosts.pids(0) == [] and hosts.pids(1) == []


@pytest.mark.timeout(90)
def test_a_launcher_killed_outright_fails_the_job_on_the_other_node(simulated_hosts, tmp_path):
    hosts = simulated_hosts(2)
    script = tmp_path / "forever.py"
    script.write_text(textwrap.dedent(FOREVER))
    out = tmp_path / "out"
    out.mkdir()
    procs = [launcher(hosts, r, script, str(out), timeout=4) for r in range(2)]
    wait_for_files([out / f"worker:{i}" for i in range(4)], procs)
    procs[1].kill()  # no chance to report: its tasks die with it, node 0 hears its heartbeat stop
    output = procs[0].communicate(timeout=60)[0]
    assert procs[0].returncode == 1, output
    assert "job failed: node 1 (its launcher) stopped answering for 4 s" in output, output
    procs[1].communicate(timeout=10)
    deadline = time.monotonic() + 10
    while hosts.pids(1):  # the killed launcher's tasks get SIGKILL from the kernel (parent death)
        assert time.monotonic() < deadline, hosts.pids(1)
        time.sleep(0.05)
    assert hosts.pids(0) == []
