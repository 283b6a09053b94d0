"""``unison launch --chief --workers 2 --ps 1``: a dying worker does not end the job."""

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent('''
    import os, threading
    import torch
    from torch import nn
    import unison

    resolver = unison.TFConfigClusterResolver()
    if resolver.task_type in ("worker", "ps"):
        server = unison.Server(resolver)
        if resolver.task_type == "worker" and resolver.task_id == 1:
            os._exit(3)  # this worker dies at once
        server.join()
        raise SystemExit(0)
    strategy = unison.ParameterServerStrategy(resolver)
    coordinator = unison.ClusterCoordinator(strategy)
    with strategy.scope():
        model = nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    def step():
        loss = (model(torch.ones(4, 2)) - 1).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
        return loss.item()
    results = [coordinator.schedule(step) for _ in range(30)]
    coordinator.join()
    print("final loss", coordinator.fetch(results[-1]))
''')


@pytest.mark.timeout(90)
def test_worker_death_does_not_end_a_ps_job(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, "-m", "unison.launch", "--chief", "--workers", "2", "--ps", "1", "--grace-period", "5",
         str(script)],
        capture_output=True, text=True, timeout=80,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "worker:1 exited with code 3; the cluster goes on" in done.stderr
    final = float(done.stdout.split("final loss")[-1])
    assert final < 0.1
