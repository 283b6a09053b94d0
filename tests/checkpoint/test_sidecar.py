"""SidecarEvaluator: every checkpoint the chief writes, in step order, then it stops (issue 13 item 5)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

import unison
from unison import mark_final, save_step_checkpoint

ROOT = Path(__file__).resolve().parents[2]


def _model(scale: float) -> nn.Module:
    model = nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.eye(2) * scale)
    return model


def _data() -> list:
    return [(torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([0, 1]))]


@pytest.mark.timeout(60)
def test_the_evaluator_sees_every_checkpoint_in_order_and_stops_at_the_final_one(tmp_path):
    chief = unison.OneDeviceStrategy("cpu:0")
    written = threading.Event()

    def train() -> None:  # the chief: a checkpoint per "epoch", written while the evaluator polls
        for step in (5, 10, 15):
            save_step_checkpoint({"model": _model(step).state_dict()}, tmp_path, step, chief)
        mark_final(tmp_path, 15, chief)
        written.set()

    evaluated = []
    evaluator = unison.SidecarEvaluator(
        _model(0), _data(), tmp_path, poll_seconds=0.01,
        eval_fn=lambda model, data: evaluated.append(model.weight[0, 0].item()) or {"scale": model.weight[0, 0].item()})
    writer = threading.Thread(target=train)
    writer.start()
    results = evaluator.start()
    writer.join()
    assert written.is_set()
    assert list(results) == [5, 10, 15] and evaluated == [5.0, 10.0, 15.0]


def test_default_metrics_and_max_evaluations(tmp_path):
    chief = unison.OneDeviceStrategy("cpu:0")
    for step in (1, 2, 3):
        save_step_checkpoint({"model": _model(1.0 if step < 3 else -1.0).state_dict()}, tmp_path, step, chief)
    results = unison.SidecarEvaluator(_model(0), _data(), tmp_path, max_evaluations=2).start()
    assert list(results) == [1, 2] and results[1]["accuracy"] == 1.0 and results[1]["loss"] > 0


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(TypeError, match="nn.Module"):
        unison.SidecarEvaluator("model", [], tmp_path)
    with pytest.raises(ValueError, match="max_evaluations"):
        unison.SidecarEvaluator(_model(1), [], tmp_path, max_evaluations=0)


@pytest.mark.timeout(150)
def test_launch_with_an_evaluator_beside_training(tmp_path):
    pytest.importorskip("sklearn", reason="scikit-learn not installed: pip install -e '.[examples]'")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    env.pop("TF_CONFIG", None)
    done = subprocess.run(
        [sys.executable, "-m", "unison.launch", "--workers", "2", "--evaluator", str(ROOT / "examples" / "digits.py"),
         "--epochs", "2", "--checkpoint", str(tmp_path / "digits.pt"), "--backup-dir", str(tmp_path / "backup"),
         "--eval-dir", str(tmp_path / "eval")],
        env=env, capture_output=True, text=True, timeout=140, cwd=tmp_path,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "[evaluator:0] evaluator: step 1:" in output and "[evaluator:0] evaluator: step 2:" in output
    assert "evaluated 2 checkpoints (steps [1, 2])" in output
    assert not (tmp_path / "backup").exists()  # BackupAndRestore deleted its backup when training finished
