"""``examples/ctr.py``: the DLRM trains on one device and under ``unison launch --workers 2 --ps 1``."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ctr.py"


def _example_module():
    """``examples/ctr.py`` imported in this process (its directory on the path only meanwhile)."""
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        import ctr
    finally:
        sys.path.remove(str(EXAMPLE.parent))
    return ctr


def _run(args, tmp_path, timeout):
    out = tmp_path / "result.json"
    done = subprocess.run([sys.executable, *args, "--train", "16384", "--test", "4096", "--json", str(out)],
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text()), done


@pytest.mark.timeout(120)
def test_the_hybrid_job_learns_as_one_device_does(tmp_path):
    """Both learn, and the hybrid job about as well as one device at the same global batch.

    The hybrid job's rows are asynchronous (not bit-reproducible), so its AUC spreads: after
    these 16k samples one device reaches about 0.66 and the hybrid job was seen at 0.645-0.665
    (commit 454fcf0: 0.649 failed the old 0.65 bound). The bounds sit between that and an
    untrained model, which scores 0.49-0.51 on these 4096 test samples (``--train 0``, seeds
    0-2): AUC > 0.58 leaves the trained runs 0.065 of margin and fails an untrained one by
    0.07; the gap to one device (at most 0.015 seen) may be 0.03, and an untrained hybrid
    job's (0.16) fails it.
    """
    hybrid, done = _run(["-m", "unison.launch", "--workers", "2", "--ps", "1", str(EXAMPLE)], tmp_path, 100)
    # One device in this process, as the tests below run it: the same script and flags, without a
    # second interpreter importing torch (the launched job above runs the example as a script).
    ctr = _example_module()
    out = tmp_path / "alone.json"
    ctr.main(["--strategy", "one_device", "--batch-size", "512", "--train", "16384", "--test", "4096",
              "--json", str(out)])
    alone = json.loads(out.read_text())
    assert "[worker:0] [hybrid] rows per ps task" in done.stdout
    assert hybrid["samples"] == alone["samples"] == 16384
    assert hybrid["auc"] > 0.58 and alone["auc"] > 0.58, (hybrid, alone)  # untrained: 0.49-0.51
    assert abs(hybrid["auc"] - alone["auc"]) < 0.03, (hybrid, alone)  # the global batch is 512 in both


@pytest.mark.timeout(120)
@pytest.mark.parametrize("optimizer", ["adagrad", "rowwise_adagrad", "sparse_adam", "ftrl"])
def test_every_row_optimizer_trains_the_example_on_one_device(optimizer, tmp_path):
    ctr = _example_module()
    out = tmp_path / "result.json"
    ctr.main(["--strategy", "one_device", "--train", "2048", "--test", "512", "--batch-size", "256",
              "--optimizer", optimizer, "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["optimizer"] == optimizer and result["samples"] == 2048 and result["rows"] > 0
    model, optimizers = ctr._model(ctr._parse(["--optimizer", optimizer]))
    names = [type(o).__name__ for o in optimizers]
    assert names == {"adagrad": ["Adagrad"], "rowwise_adagrad": ["Adagrad"], "sparse_adam": ["SparseAdam", "Adam"],
                     "ftrl": ["Ftrl", "Adagrad"]}[optimizer]
    assert model.embeddings.row_wise_adagrad == (optimizer == "rowwise_adagrad")


@pytest.mark.timeout(120)
def test_admission_and_a_capacity_bound_the_rows_and_the_model_still_learns(tmp_path):
    """``--admit-after 2 --capacity 20000``: of the 62883 ids these 16k samples hold, 18220 are seen
    twice or more (the rest read zeros), under the capacity; AUC 0.667 against 0.665 without."""
    ctr = _example_module()
    out = tmp_path / "result.json"
    ctr.main(["--strategy", "one_device", "--train", "16384", "--test", "4096", "--batch-size", "512",
              "--admit-after", "2", "--capacity", "20000", "--json", str(out)])
    result = json.loads(out.read_text())
    assert 0 < result["rows"] <= 20000 and result["auc"] > 0.58, result


@pytest.mark.timeout(120)
def test_the_table_is_saved_by_delta_and_exported_for_serving(tmp_path):
    """``--delta-every 2 --full-every 3``: 8 steps save at 2 (full), 4, 6, 8 (deltas); the chain loads to
    the trained table, and the serving export written at the end serves the same rows."""
    ctr = _example_module()
    import torch

    import unison

    ckpt, export = tmp_path / "ckpt", tmp_path / "export"
    ctr.main(["--strategy", "one_device", "--train", "2048", "--test", "512", "--batch-size", "256",
              "--checkpoint-dir", str(ckpt), "--delta-every", "2", "--full-every", "3", "--export-dir", str(export)])
    names = sorted(p.name for p in ckpt.iterdir())
    assert names == ["step-00000002-full.pt", "step-00000004-delta.pt", "step-00000006-delta.pt",
                     "step-00000008-delta.pt"]
    saves = [unison.load_checkpoint(ckpt / name) for name in names]
    model, _ = ctr._model(ctr._parse([]))
    model.embeddings.load_state_dict(saves[0]["table"])
    for save in saves[1:]:
        model.embeddings.load_delta_state_dict(save["table"])
    chained = model.embeddings.state_dict()
    served = unison.embeddings.ServingEmbedding.load(export)
    assert served.num_rows == chained["ids"].numel() > 0
    assert torch.equal(served._rows_of(chained["ids"]), chained["rows"])
