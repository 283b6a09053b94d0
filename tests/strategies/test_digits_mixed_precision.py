"""The main job's script with mixed precision (``--amp``: bfloat16 autocast and a GradScaler) under Mirrored."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

DIGITS = Path(__file__).resolve().parents[2] / "examples" / "digits.py"


def _digits():
    spec = importlib.util.spec_from_file_location("digits_example", DIGITS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(120)
def test_mixed_precision_under_two_replicas_reaches_full_precisions_accuracy(tmp_path):
    pytest.importorskip("sklearn", reason="scikit-learn not installed: pip install -e '.[examples]'")
    digits = _digits()

    def run(*extra: str) -> dict:
        out = tmp_path / ("amp" if extra else "full")
        return digits.main(["--strategy", "mirrored", "--devices", "cpu:0,cpu:1", "--epochs", "3",
                            "--checkpoint", str(out / "digits.pt"), "--backup-dir", str(out / "backup"),
                            "--eval-dir", str(out / "eval"), *extra])

    amp, full = run("--amp"), run()
    assert amp["replicas"] == 2
    assert amp["accuracy"] >= 0.9
    assert abs(amp["accuracy"] - full["accuracy"]) <= 0.01
