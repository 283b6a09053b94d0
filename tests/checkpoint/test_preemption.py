"""PreemptionCheckpointHandler: SIGTERM to either worker, both save at the same step, restart, same weights."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import unison
from tests.checkpoint import _preemption_script
from unison._testing import run_workers

SCRIPT = Path(__file__).with_name("_preemption_script.py")
ROOT = Path(__file__).resolve().parents[2]


def _launch(out: Path, signal_rank: int, signal_at: int, restarts: int) -> subprocess.CompletedProcess:
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    env.pop("TF_CONFIG", None)
    return subprocess.run(
        [sys.executable, "-m", "unison.launch", "--workers", "2", "--max-restarts", str(restarts),
         str(SCRIPT), str(out), str(signal_rank), str(signal_at)],
        env=env, capture_output=True, text=True, timeout=150,
    )


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[torch.Tensor]:
    # The same script and cluster without a signal, its two workers forked warm by run_workers
    # rather than started by `unison launch` (0.4 s instead of 7.5 s; the final weights were
    # bit-identical to a launched run's). The preempted runs below run under the launcher.
    out = tmp_path_factory.mktemp("uninterrupted")
    run_workers(_preemption_script.as_worker, 2, args=(str(out), "-1", "-1"), timeout=120, env={"TF_CONFIG": None})
    return torch.load(out / "final.pt")


@pytest.mark.timeout(200)
@pytest.mark.parametrize("signal_rank", [0, 1])
def test_sigterm_to_either_worker_saves_both_at_one_step_and_resumes_equal(tmp_path, uninterrupted, signal_rank):
    signal_at = random.Random(signal_rank).randrange(5, 95)
    done = _launch(tmp_path, signal_rank, signal_at, 1)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "was preempted" in output and "saved at the agreed step" in output and "restarting the cluster" in output
    # The launcher names the worker that got the SIGTERM, not whichever exited first with code 75.
    assert f"the job was preempted (notice to worker:{signal_rank})" in output, output
    saved = [int((tmp_path / f"saved-w{r}.txt").read_text().split()[0]) for r in (0, 1)]
    # the signal came before call signal_at + 1; after it the worker proposes one more (a peer may be
    # inside that call already), so both save after call signal_at + 2
    assert saved[0] == saved[1] == signal_at + 2, saved
    resumed = [(tmp_path / f"attempts-w{r}.txt").read_text().split("\n")[1].split() for r in (0, 1)]
    assert [r[:2] for r in resumed] == [["1", str(saved[0])], ["1", str(saved[0])]]  # total_run_calls continues
    signalled = float((tmp_path / "signalled.txt").read_text())
    print(f"SIGTERM to resumed training: {max(float(r[2]) for r in resumed) - signalled:.2f} s")
    for got, want in zip(torch.load(tmp_path / "final.pt"), uninterrupted):
        assert (got - want).abs().max().item() <= 1e-6


def test_termination_config_checks_its_fields():
    with pytest.raises(ValueError, match="grace_period"):
        unison.TerminationConfig(grace_period=-1)
    with pytest.raises(TypeError, match="exit_fn"):
        unison.TerminationConfig(exit_fn="exit")


def test_one_process_stops_after_the_step_the_signal_arrived_in(tmp_path, monkeypatch):
    notices = tmp_path / "notices"
    notices.mkdir()
    monkeypatch.setenv("UNISON_PREEMPTION_NOTICES", str(notices))  # as unison launch sets it
    strategy = unison.OneDeviceStrategy("cpu:0")
    with strategy.scope():
        model = torch.nn.Linear(2, 1)
    left = []
    handler = unison.PreemptionCheckpointHandler(strategy, tmp_path, {"model": model},
                                                 unison.TerminationConfig(exit_fn=lambda: left.append(True)))
    handler.run(lambda: None)
    assert not list(notices.iterdir())
    handler._on_signal(15, None)  # what SIGTERM calls
    assert [p.read_text() for p in notices.iterdir()] == ["local SIGTERM\n"]  # left at once, for the launcher
    handler.run(lambda: None)
    assert left == [True] and handler.total_run_calls == 2
    restored = unison.PreemptionCheckpointHandler(strategy, tmp_path, {"model": model})
    assert restored.total_run_calls == 2
