"""The ensemble example on a real parameter-server cluster: chief + 4 workers + 2 ps (issue 12 item 4)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from unison.placement import PlacementConfig, RoundRobinStrategy, subnetwork_ps_group

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(240)
def test_round_robin_ensemble_trains_on_a_cluster_as_the_placement_says(tmp_path):
    pytest.importorskip("sklearn", reason="scikit-learn not installed: pip install -e '.[examples]'")
    report = tmp_path / "report.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    env.pop("TF_CONFIG", None)
    done = subprocess.run(
        [sys.executable, "-m", "unison.launch", "--chief", "--workers", "4", "--ps", "2",
         str(ROOT / "examples" / "ensemble.py"), "--placement", "round_robin", "--steps", "200",
         "--checkpoint", str(tmp_path / "ensemble.pt"), "--report", str(report)],
        env=env, capture_output=True, text=True, timeout=230, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(report.read_text())
    placement = RoundRobinStrategy()
    for worker, row in result["workers"].items():  # what each worker trained is what the table says
        placement.config = PlacementConfig(num_worker_replicas=4, global_id_in_cluster=int(worker), num_ps_replicas=2)
        expected = [i for i in range(3) if placement.should_build_subnetwork(3, i)] \
            if placement.should_train_subnetworks(3) else []
        assert row["trained"] == expected and row["ensemble"] == placement.should_build_ensemble(3), (worker, row)
    for index in range(3):  # every subnetwork's parameters on its dedicated ps group
        group = subnetwork_ps_group(2, 3, index)
        assert result["placements"][f"subnetwork {index}"] == [f"/job:ps/replica:0/task:{t}" for t in group]
    best = max(result["accuracy"][f"subnetwork {i}"] for i in range(3))
    assert result["accuracy"]["ensemble"] >= best - 0.01, result["accuracy"]
    assert (tmp_path / "ensemble.pt").is_file()
