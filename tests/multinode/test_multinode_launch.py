"""``unison launch --nnodes 2`` on two simulated hosts: training, failures, fallbacks, rendezvous."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.multinode.train_script import single_device_weights
from unison._launch.core_binding import plan_cores

SCRIPT = str(Path(__file__).with_name("train_script.py"))
ROOT = str(Path(__file__).parents[2])


def launch_command(hosts, node_rank, *script_args, timeout=60, extra=()):
    return [
        sys.executable, "-m", "unison.launch", "--nnodes", "2", "--node-rank", str(node_rank),
        "--master-addr", hosts.address(0), "--workers-per-node", "2", "--rendezvous-timeout", str(timeout),
        "--grace-period", "2", *extra, SCRIPT, *script_args,
    ]  # fmt: skip


def launch_both(hosts, *script_args, **options):
    return [hosts.popen(i, launch_command(hosts, i, *script_args, **options), cwd=ROOT) for i in range(2)]


def finish(processes, timeout=150):
    return [p.communicate(timeout=timeout)[0] for p in processes]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("implementation", ["RING", "AUTO"])
def test_training_on_two_hosts_equals_single_device_training(simulated_hosts, tmp_path, implementation):
    hosts = simulated_hosts(2)
    launchers = launch_both(hosts, str(tmp_path), "--implementation", implementation)
    outputs = finish(launchers)
    assert [p.returncode for p in launchers] == [0, 0], outputs
    assert "node 0 at 10.201.0.1, node 1 at 10.201.0.2" in outputs[0]
    for node, output in enumerate(outputs):
        for index in (2 * node, 2 * node + 1):  # node r runs workers 2r and 2r+1, output prefixed
            assert f"[worker:{index}] worker:{index} done" in output
    assert_equals_single_device(tmp_path, 4)
    assert hosts.pids(0) == [] and hosts.pids(1) == []


def assert_equals_single_device(out, workers):
    want = single_device_weights()
    for index in range(workers):
        got = torch.load(out / f"worker:{index}.pt")["weights"]
        assert max((g - w).abs().max().item() for g, w in zip(got, want)) <= 1e-5


@pytest.mark.timeout(200)
def test_a_host_whose_shared_memory_is_too_small_falls_back_without_a_hang(simulated_hosts, tmp_path):
    # One node, its two workers on one host: shared memory is tried, and /dev/shm is too small.
    hosts = simulated_hosts(1, shm_size="8k")
    command = [sys.executable, "-m", "unison.launch", "--nnodes", "1", "--master-addr", hosts.address(0),
               "--workers-per-node", "2", "--rendezvous-timeout", "60", SCRIPT, str(tmp_path)]  # fmt: skip
    launcher = hosts.popen(0, command, cwd=ROOT)
    output = launcher.communicate(timeout=150)[0]
    assert launcher.returncode == 0, output
    assert "[worker:0] unison: no shared memory between the workers" in output, output
    assert "No space left on device" in output
    assert_equals_single_device(tmp_path, 2)
    # Two hosts of two workers (AUTO: hierarchical, shared memory within each host), the
    # first one's /dev/shm too small: every worker falls back to gloo, same weights.
    hosts = simulated_hosts(2, shm_sizes={0: "8k"})
    out = tmp_path / "two-hosts"
    out.mkdir()
    launchers = launch_both(hosts, str(out), "--implementation", "AUTO")
    outputs = finish(launchers)
    assert [p.returncode for p in launchers] == [0, 0], outputs
    assert "[worker:0] unison: no shared memory between the workers" in outputs[0] and "No space left" in outputs[0]
    assert "[worker:3] unison: no shared memory between the workers" in outputs[1], outputs[1]
    assert_equals_single_device(out, 4)


@pytest.mark.timeout(200)
def test_a_worker_killed_on_host_b_fails_every_worker_and_both_launchers(simulated_hosts, tmp_path):
    hosts = simulated_hosts(2)
    launchers = launch_both(hosts, str(tmp_path), "--forever")
    pid_files = [tmp_path / f"worker:{i}.pid" for i in range(4)]
    deadline = time.monotonic() + 120
    while not all(f.exists() for f in pid_files):  # every worker has finished one step
        assert time.monotonic() < deadline and all(p.poll() is None for p in launchers), finish(launchers)
        time.sleep(0.1)
    killed = int(pid_files[3].read_text())
    assert killed in hosts.pids(1)  # worker:3 runs on host B
    os.kill(killed, signal.SIGKILL)
    outputs = finish(launchers, timeout=60)
    codes = [p.returncode for p in launchers]
    assert codes == [137, 137], outputs  # the failed task's code (128 + SIGKILL) on every node
    for output in outputs:
        assert "job failed: task worker:3 on node 1 exited with code 137 (killed by SIGKILL)" in output, output
    # Every other worker, on both hosts, fails by itself with an error naming the lost peer
    # (the launchers give them SETTLE_SECONDS before SIGTERM; the workers' store lives in
    # node 0's launcher, so the heartbeats stay readable whoever exits first).
    # Under load a worker can be stopped by its launcher before it prints its own error, so
    # every error that is printed must name worker:3, and each host must have printed one.
    named = {}
    for index in (0, 1, 2):
        errors = [
            line for line in "".join(outputs).splitlines()
            if line.startswith(f"[worker:{index}]") and "PeerLostError" in line and "missing task(s):" in line
        ]  # fmt: skip
        for error in errors:
            assert "worker:3" in error.split("missing task(s):")[1].split(";")[0], error
        named[index] = bool(errors)
    assert (named[0] or named[1]) and named[2], (named, outputs)  # host A (workers 0, 1) and host B (worker 2)
    assert hosts.pids(0) == [] and hosts.pids(1) == []


AFFINITY_REPORT = """
import json, os, sys
from pathlib import Path
task = json.loads(os.environ["TF_CONFIG"])["task"]
name = "{}:{}.json".format(task["type"], task["index"])
Path(sys.argv[1], name).write_text(json.dumps(sorted(os.sched_getaffinity(0))))
"""


@pytest.mark.timeout(120)
def test_bind_cores_binds_each_nodes_own_tasks_on_that_node(simulated_hosts, tmp_path):
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("binding two tasks a node needs two CPUs")
    script = tmp_path / "report.py"
    script.write_text(AFFINITY_REPORT)
    hosts = simulated_hosts(2)
    commands = [[*launch_command(hosts, i, extra=("--bind-cores",))[:-1], str(script), str(tmp_path)]
                for i in range(2)]
    launchers = [hosts.popen(i, commands[i], cwd=ROOT) for i in range(2)]
    outputs = finish(launchers)
    assert [p.returncode for p in launchers] == [0, 0], outputs
    seen = {index: json.loads((tmp_path / f"worker:{index}.json").read_text()) for index in range(4)}
    plan = plan_cores(["first", "second"])  # how the CPUs split is tested in tests/launch/test_core_binding.py
    for node in range(2):  # each node splits the CPUs among its own two workers (the hosts share this machine's)
        assert [seen[2 * node], seen[2 * node + 1]] == [list(plan["first"]), list(plan["second"])], seen
        assert f"bound worker:{2 * node} on CPU" in outputs[node]
