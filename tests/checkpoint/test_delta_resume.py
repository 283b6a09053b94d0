"""BackupAndRestore(full_every=K) saves DynamicEmbedding tables as a full save point and deltas: a job
killed between deltas resumes from the full file and its deltas to the weights of an uninterrupted run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import unison
from tests.checkpoint._delta_resume_job import train
from unison._testing import WorkerResult, run_workers


def _run(out: Path, kill_at: int) -> WorkerResult:
    """One attempt of the job in a process of its own (forked warm: no interpreter to start)."""
    out.mkdir(parents=True, exist_ok=True)
    [result] = run_workers(train, 1, args=(str(out), kill_at), timeout=120, env={"TF_CONFIG": None},
                           allow_failures=True)
    return result


@pytest.mark.timeout(300)
def test_a_job_killed_between_deltas_resumes_from_full_and_deltas_to_the_same_weights(tmp_path):
    clean = _run(tmp_path / "clean", -1)
    assert clean.ok, clean.error
    assert not (tmp_path / "clean" / "backup").exists()  # deleted when training finished, table files too

    out = tmp_path / "killed"
    killed = _run(out, 38)
    assert killed.exitcode == -9, killed.error
    # saves at 5 (full), 10, 15 (deltas), 20 (full), 25, 30 (deltas), 35 (full): the chain at 38 is the full at 35
    # and older files are gone; kill at 33 instead to stand between deltas
    resumed = _run(out, -1)
    assert resumed.ok, resumed.error
    assert (out / "attempts.txt").read_text().split() == ["0", "35"]
    _assert_same(torch.load(out / "final.pt"), torch.load(tmp_path / "clean" / "final.pt"))

    between = tmp_path / "between"
    killed = _run(between, 33)
    assert killed.exitcode == -9, killed.error
    assert (between / "killed.txt").read_text().split() == ["tables-20.pt", "tables-25.pt", "tables-30.pt"]
    resumed = _run(between, -1)
    assert resumed.ok, resumed.error
    assert (between / "attempts.txt").read_text().split() == ["0", "30"]
    _assert_same(torch.load(between / "final.pt"), torch.load(tmp_path / "clean" / "final.pt"))


def _assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(got[key], value), key
    meta = {k: v for k, v in got["emb._extra_state"].items() if k not in ("table_id", "sequence", "exact")}
    assert meta == {k: v for k, v in want["emb._extra_state"].items() if k not in ("table_id", "sequence", "exact")}


def test_full_every_needs_a_table_and_a_count(tmp_path):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"full_every=2.*no entry of `state` \(\['model'\]\).*delta_state_dict"):
        unison.BackupAndRestore(tmp_path, unison.get_strategy(), {"model": model}, save_freq=5, full_every=2)
    with pytest.raises(ValueError, match=r"`full_every` must be None or .* got -1"):
        unison.BackupAndRestore(tmp_path, unison.get_strategy(), {"model": model}, save_freq=5, full_every=-1)
