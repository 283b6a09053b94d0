"""``unison launch --workers 2 --ps 1 --max-restarts 1``: a hybrid job's workers restart, its ps rows stay."""

import subprocess
import sys
import textwrap

import pytest

from unison._launch.kept_ps import keeps_ps_tasks
from unison._launch.procs import Task

SCRIPT = textwrap.dedent('''
    import os
    import torch
    import unison

    resolver = unison.TFConfigClusterResolver()
    if resolver.task_type == "ps":
        print("ps pid", os.getpid(), flush=True)
        unison.Server(resolver).join()
        raise SystemExit(0)
    restart = int(os.environ["UNISON_RESTART_COUNT"])
    strategy = unison.HybridParameterServerStrategy(resolver, timeout_seconds=20)
    with strategy.scope():
        emb = unison.DynamicEmbedding(4, mode="sum")
        opt = torch.optim.Adagrad(emb.parameters(), lr=0.1)
    strategy.join_pushes()  # nobody has trained yet
    found = emb.num_rows
    strategy.join_pushes()
    def step(ids):
        loss = emb(ids).square().sum()
        opt.zero_grad(); loss.backward(); opt.step()
    for i in range(3):
        strategy.run(step, args=(torch.arange(8).reshape(4, 2) + 100 * resolver.task_id + 1000 * restart,))
    strategy.join_pushes()
    print(f"restart {restart}: found {found} rows, now {emb.num_rows}", flush=True)
    strategy.join_pushes()  # both printed: the worker that dies next cannot cut the other's line off
    if restart == 0 and resolver.task_id == 1:
        os._exit(7)  # a worker dies after training: the job restarts its workers
''')


def test_only_jobs_without_a_chief_keep_their_ps_tasks():
    assert keeps_ps_tasks([Task("worker", 0), Task("ps", 0)])
    assert not keeps_ps_tasks([Task("chief", 0), Task("worker", 0), Task("ps", 0)])
    assert not keeps_ps_tasks([Task("worker", 0), Task("worker", 1)])


@pytest.mark.timeout(120)
def test_a_restart_starts_the_workers_again_and_the_ps_task_keeps_its_rows(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, "-m", "unison.launch", "--workers", "2", "--ps", "1", "--max-restarts", "1",
         "--grace-period", "5", str(script)],
        capture_output=True, text=True, timeout=110,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "restarting the workers (restart 1 of 1); the ps tasks keep running" in done.stderr
    assert done.stdout.count("ps pid") == 1  # started once
    assert "[worker:0] restart 0: found 0 rows, now 16" in done.stdout
    # the restarted workers find the 16 rows the first ones made, and add 16 of their own
    assert "[worker:0] restart 1: found 16 rows, now 32" in done.stdout
