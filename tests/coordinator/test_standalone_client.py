"""STANDALONE_CLIENT mode against real standard servers (`unison server` processes)."""

import json
import os
import pickle
import socket
import struct
import sys
import time
from pathlib import Path

import _coordinator_fakes
import cloudpickle
import pytest
from _coordinator_fakes import FakeStrategy
from _coordinator_procs import Processes, alive

from unison._launch.procs import reserve_ports
from unison.coordinator import (
    generate_authkey,
    get_current_worker_context,
    run_distribute_coordinator,
    stop_standard_servers,
)
from unison.errors import AuthenticationError, ClusterError

# The servers cannot import this test module: send its functions (and the fake) by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
cloudpickle.register_pickle_by_value(_coordinator_fakes)

SERVER_SCRIPT = "import sys\nfrom unison._launch.cli import main\nsys.exit(main(['server']))\n"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two workers and an evaluator, each a `unison server` process; stopped at the end."""
    script = tmp_path_factory.mktemp("servers") / "server.py"
    script.write_text(SERVER_SCRIPT)
    ports = reserve_ports(3)
    spec = {"worker": [f"127.0.0.1:{ports[0]}", f"127.0.0.1:{ports[1]}"], "evaluator": [f"127.0.0.1:{ports[2]}"]}
    key = generate_authkey()
    processes = Processes()
    try:
        servers = []
        for job, index in (("worker", 0), ("worker", 1), ("evaluator", 0)):
            env = dict(os.environ, UNISON_AUTHKEY=key.hex(),
                       TF_CONFIG=json.dumps({"cluster": spec, "task": {"type": job, "index": index}}))
            servers.append(processes.python(script, env=env))
        yield spec, key, servers
        assert sorted(stop_standard_servers(spec, authkey=key, timeout=30)) == ["evaluator:0", "worker:0", "worker:1"]
        assert [server.wait(timeout=30) for server in servers] == [0, 0, 0]
    finally:
        processes.close()


def describe(strategy):
    context = get_current_worker_context()
    return {
        "task": [context.task_type, context.task_id],
        "pid": os.getpid(),
        "chief": context.is_chief,
        "workers": context.num_workers,
        "target": context.master_target,
        "configured": strategy.configured if strategy is not None else None,
        "rendezvous": getattr(strategy, "rendezvous", None),
        "environ_rendezvous": os.environ.get("UNISON_RENDEZVOUS"),
        "should_checkpoint": context.should_checkpoint,
        "distributed": context.distributed_mode,
    }


@pytest.mark.timeout(90)
def test_client_returns_the_result_of_each_worker(cluster):
    spec, key, servers = cluster
    results = run_distribute_coordinator(describe, FakeStrategy(), eval_fn=describe, cluster_spec=spec, authkey=key,
                                         environ={})
    assert sorted(results) == ["evaluator", "worker"]
    worker0, worker1 = results["worker"]
    assert worker0["task"] == ["worker", 0] and worker1["task"] == ["worker", 1]
    assert {worker0["pid"], worker1["pid"]} == {servers[0].pid, servers[1].pid}  # ran in the servers
    assert (worker0["chief"], worker1["chief"]) == (True, False)
    assert (worker0["should_checkpoint"], worker1["should_checkpoint"]) == (True, False)
    assert worker0["configured"] == (spec, "worker", 0)  # each server configured its own copy
    # The client's store reached configure as an argument; the servers' environment was left alone.
    assert worker0["rendezvous"] == worker1["rendezvous"] and worker0["rendezvous"].startswith("127.0.0.1:")
    assert worker0["rendezvous"] not in (worker0["environ_rendezvous"], worker1["environ_rendezvous"])
    assert worker1["target"] == f"tcp://{spec['worker'][1]}"
    assert worker0["workers"] == 2 and worker0["distributed"]
    (evaluator,) = results["evaluator"]
    assert evaluator["task"] == ["evaluator", 0] and evaluator["pid"] == servers[2].pid
    assert evaluator["configured"] is None and not evaluator["distributed"] and evaluator["chief"]


def slow_and_fast(marker_dir):
    def worker_fn(strategy):
        context = get_current_worker_context()
        arrived = Path(marker_dir) / "slow-worker-arrived"
        if context.task_id == 1:  # the slow worker
            time.sleep(0.5)
            arrived.write_text(str(time.time()))
            context.wait_for_other_workers()
            return "slow"
        context.wait_for_other_workers()
        return arrived.exists()  # the fast worker passed only after the slow one arrived

    return worker_fn


@pytest.mark.timeout(90)
def test_barrier_blocks_the_fast_worker_until_the_slow_one_arrives(cluster, tmp_path):
    spec, key, _ = cluster
    results = run_distribute_coordinator(
        slow_and_fast(tmp_path), FakeStrategy(), eval_fn=lambda s: "eval", cluster_spec=spec, authkey=key, environ={}
    )
    assert results == {"worker": [True, "slow"], "evaluator": ["eval"]}


def fail_on_worker_1(strategy):
    context = get_current_worker_context()
    if context.task_id == 1:
        raise ValueError("boom on worker 1")
    context.wait_for_other_workers()  # released (broken) because worker 1 failed
    return "unreachable"


@pytest.mark.timeout(90)
def test_a_failing_worker_is_named_and_does_not_hang_the_others(cluster):
    spec, key, _ = cluster
    with pytest.raises(ClusterError) as info:
        run_distribute_coordinator(fail_on_worker_1, FakeStrategy(), eval_fn=lambda s: None, cluster_spec=spec,
                                   authkey=key, environ={})
    message = str(info.value)
    assert "worker:1" in message and "boom on worker 1" in message
    remote = info.value.__cause__.__cause__  # client error <- task error <- the remote exception
    assert isinstance(remote, ValueError) and str(remote) == "boom on worker 1"


class Evil:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.timeout(90)
def test_wrong_key_is_refused_and_the_servers_keep_serving(cluster, tmp_path):
    spec, key, servers = cluster
    marker = tmp_path / "executed"
    with pytest.raises(ClusterError) as info:
        run_distribute_coordinator(lambda s: marker.write_text("x"), FakeStrategy(), cluster_spec=spec,
                                   authkey=b"w" * 32, environ={})
    assert isinstance(info.value.__cause__, AuthenticationError)
    host, port = spec["worker"][0].split(":")
    with socket.create_connection((host, int(port))) as raw:  # no handshake: pickles straight away
        payload = pickle.dumps(Evil(marker))
        raw.sendall((struct.pack("!i", len(payload)) + payload) * 2)
        raw.recv(1024)
    assert all(server.poll() is None for server in servers)
    results = run_distribute_coordinator(describe, FakeStrategy(), eval_fn=describe, cluster_spec=spec, authkey=key,
                                         environ={})
    assert [r["task"] for r in results["worker"]] == [["worker", 0], ["worker", 1]]
    assert not marker.exists()
    assert all(alive(server.pid) for server in servers)
