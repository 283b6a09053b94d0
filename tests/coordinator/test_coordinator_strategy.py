"""MultiWorkerMirroredStrategy driven by the distribute coordinator, in both modes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import cloudpickle
import pytest

import unison
from unison._launch.procs import reserve_ports
from unison.coordinator import generate_authkey, stop_standard_servers

REPO = Path(__file__).resolve().parents[2]
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def train_and_describe(strategy):
    import torch

    context = unison.coordinator.get_current_worker_context()
    with strategy.scope():
        torch.manual_seed(context.task_id)  # different local init: the chief's must win
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.arange(64.0).reshape(8, 2, 4)[:, context.task_id] / 64  # each worker its own rows
    for _ in range(3):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    context.wait_for_other_workers()
    return {"replicas": strategy.num_replicas_in_sync, "weight": model.weight.detach().tolist(),
            "chief": strategy.extended.should_checkpoint}


@pytest.mark.timeout(120)
def test_standalone_client_trains_on_two_standard_servers(tmp_path):
    script = tmp_path / "server.py"
    script.write_text("import sys\nfrom unison._launch.cli import main\nsys.exit(main(['server']))\n")
    ports = reserve_ports(2)
    spec = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    key = generate_authkey()
    servers = []
    try:
        for index in range(2):
            env = dict(os.environ, UNISON_AUTHKEY=key.hex(), PYTHONPATH=str(REPO / "src"),
                       TF_CONFIG=json.dumps({"cluster": spec, "task": {"type": "worker", "index": index}}))
            servers.append(subprocess.Popen([sys.executable, str(script)], env=env, start_new_session=True))
        strategy = unison.MultiWorkerMirroredStrategy(
            unison.SimpleClusterResolver(unison.ClusterSpec({})),
            unison.CommunicationOptions(timeout_seconds=30),
        )
        results = unison.coordinator.run_distribute_coordinator(
            train_and_describe, strategy, mode=unison.coordinator.CoordinatorMode.STANDALONE_CLIENT,
            cluster_spec=spec, authkey=key, environ={},
        )
        first, second = results["worker"]
        assert first["replicas"] == second["replicas"] == 2
        assert first["weight"] == second["weight"]
        assert (first["chief"], second["chief"]) == (True, False)
        assert sorted(stop_standard_servers(spec, authkey=key, timeout=30)) == ["worker:0", "worker:1"]
        assert [s.wait(timeout=30) for s in servers] == [0, 0]
    finally:
        for server in servers:
            if server.poll() is None:
                server.kill()
                server.wait()


@pytest.mark.timeout(120)
def test_independent_workers_and_evaluator_under_the_launcher(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import torch, unison

        def worker_fn(strategy):
            context = unison.coordinator.get_current_worker_context()
            with strategy.scope():
                torch.manual_seed(context.task_id)
                model = torch.nn.Linear(3, 1)
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(3):
                opt.zero_grad()
                model(torch.full((4, 3), float(context.task_id + 1))).sum().backward()
                opt.step()
            print("trained", context.task_type, context.task_id, strategy.num_replicas_in_sync,
                  [round(v, 6) for v in model.weight.detach().flatten().tolist()], flush=True)

        def eval_fn(strategy):
            print("evaluated", unison.coordinator.get_current_worker_context().task_type, flush=True)

        unison.coordinator.run_distribute_coordinator(
            worker_fn, unison.MultiWorkerMirroredStrategy(unison.SimpleClusterResolver(unison.ClusterSpec({}))),
            eval_fn=eval_fn, mode=unison.coordinator.CoordinatorMode.INDEPENDENT_WORKER)
    """))
    done = subprocess.run([sys.executable, "-m", "unison.launch", "--workers", "2", "--evaluator", str(script)],
                          cwd=REPO, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stdout + done.stderr
    trained = [line.split(" ", 1)[1] for line in done.stdout.splitlines() if " trained " in line]
    assert len(trained) == 2
    weights = {line.rsplit("[", 1)[1] for line in trained}
    assert len(weights) == 1  # both workers hold the same weights
    assert all(" 2 [" in line for line in trained)  # 2 replicas in sync
    assert "[evaluator:0] evaluated evaluator" in done.stdout
