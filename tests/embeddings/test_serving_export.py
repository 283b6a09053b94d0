"""Serving exports: ServingEmbedding reads a full export as the trained table's rows, applies a later delta
export in place (to the rows at that export), refuses the wrong delta changing nothing, and answers lookups
while deltas land."""

from __future__ import annotations

import json
import threading

import pytest
import torch

import unison
from unison.embeddings import EvictUnseen, ServingEmbedding, export_for_serving

pytestmark = pytest.mark.timeout(120)


def make(mode: str | None = "sum") -> tuple[unison.DynamicEmbedding, torch.optim.Optimizer]:
    emb = unison.DynamicEmbedding(4, mode=mode, seed=3, eviction=EvictUnseen(3))
    return emb, torch.optim.Adagrad(emb.parameters(), lr=0.1)


def train(emb, opt, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for i in range(steps):
        ids = torch.randint(0, 300, (16, 3), generator=g) + 41 * (seed * steps + i)
        opt.zero_grad()
        out = emb(ids) if emb.mode else emb(ids).sum(1)
        out.pow(2).sum().backward()
        opt.step()


def assert_serves(served: ServingEmbedding, emb: unison.DynamicEmbedding) -> None:
    state = emb.state_dict()
    ids, rows = state["ids"], state["rows"]
    assert served.num_rows == ids.numel()
    got = served._rows_of(ids)
    assert torch.equal(got, rows)


def test_a_full_export_serves_the_trained_rows_and_a_delta_brings_it_to_the_later_export(tmp_path):
    emb, opt = make("sum")
    train(emb, opt, 4, seed=0)
    path = export_for_serving(emb, tmp_path / "export-0")
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["kind"] == "full" and manifest["mode"] == "sum" and manifest["base"] is None
    assert sorted(p.name for p in path.iterdir()) == ["ids.bin", "manifest.json", "removed.bin", "rows.bin"]
    served = ServingEmbedding.load(path, default=0.25)
    assert_serves(served, emb)
    emb.eval()
    bags = torch.tensor([[0, 5, 7], [100, 2**62, 3]])  # 2**62 has no row: it reads the default
    known = emb.state_dict()["ids"][:6].reshape(2, 3)
    with torch.no_grad():
        assert torch.equal(served(known), emb(known))
        want = emb.table.lookup(bags.reshape(-1), create=False).reshape(2, 3, 4)
    have = torch.isin(bags, emb.state_dict()["ids"]).unsqueeze(-1)
    assert torch.allclose(served(bags), torch.where(have, want, torch.tensor(0.25)).sum(1))
    assert served.num_rows == emb.num_rows  # lookups made no rows
    emb.train()

    train(emb, opt, 5, seed=1)  # rows change, new ids come, old ones are evicted
    delta = export_for_serving(emb, tmp_path / "export-1", delta=True)
    manifest = json.loads((delta / "manifest.json").read_text())
    assert manifest["kind"] == "delta" and manifest["base"] == 0 and manifest["number"] == 1
    assert manifest["arrays"]["removed"]["shape"][0] > 0
    served.apply_delta(delta)
    assert_serves(served, emb)
    train(emb, opt, 2, seed=2)
    served.apply_delta(export_for_serving(emb, tmp_path / "export-2", delta=True))
    assert_serves(served, emb)


def test_one_id_per_row_mode_serves_like_the_module_in_evaluation(tmp_path):
    emb, opt = make(None)
    train(emb, opt, 3, seed=0)
    served = ServingEmbedding.load(export_for_serving(emb, tmp_path / "e"))
    ids = emb.state_dict()["ids"][:10].reshape(2, 5)
    with torch.no_grad():
        assert torch.equal(served(ids), emb.eval()(ids))
    assert served(torch.tensor([2**63 - 1])).eq(0).all()


def test_a_compiled_serving_model_reads_the_table_eagerly(tmp_path):
    """``torch.compile`` runs the table's lookups eagerly (a graph break) and compiles the rest."""
    emb, opt = make("sum")
    train(emb, opt, 3, seed=0)
    served = ServingEmbedding.load(export_for_serving(emb, tmp_path / "e"))
    ids = emb.state_dict()["ids"][:12].reshape(3, 4)
    scaled = torch.compile(lambda i: served(i) * 2 + served.lookup(i).sum(1), backend="eager")
    with torch.no_grad():
        assert torch.equal(scaled(ids), served(ids) * 2 + served.lookup(ids).sum(1))


def test_a_wrong_delta_is_refused_naming_both_and_changes_nothing(tmp_path):
    emb, opt = make()
    train(emb, opt, 2, seed=0)
    served = ServingEmbedding.load(export_for_serving(emb, tmp_path / "0"))
    train(emb, opt, 2, seed=1)
    first = export_for_serving(emb, tmp_path / "1", delta=True)
    train(emb, opt, 2, seed=2)
    second = export_for_serving(emb, tmp_path / "2", delta=True)
    before = served._rows_of(torch.arange(-5, 20000)).clone()
    with pytest.raises(ValueError, match="export 1 -> 2 .* at export 0: it is out of order; nothing was changed"):
        served.apply_delta(second)
    other, other_opt = make()
    train(other, other_opt, 1, seed=7)
    export_for_serving(other, tmp_path / "o0")
    train(other, other_opt, 1, seed=8)
    with pytest.raises(ValueError, match=f"chain '\\w+' but this table is chain '{served.export_id}'"):
        served.apply_delta(export_for_serving(other, tmp_path / "o1", delta=True))
    with pytest.raises(ValueError, match="a full export"):
        served.apply_delta(tmp_path / "0")
    assert torch.equal(served._rows_of(torch.arange(-5, 20000)), before)
    served.apply_delta(first)
    with pytest.raises(ValueError, match="already applied"):
        served.apply_delta(first)
    served.apply_delta(second)
    assert_serves(served, emb)


def test_bad_input_names_the_field_and_the_fix(tmp_path):
    emb, opt = make()
    with pytest.raises(ValueError, match=r"needs an export before it.*delta=False"):
        export_for_serving(emb, tmp_path / "d", delta=True)
    path = export_for_serving(emb, tmp_path / "0")
    with pytest.raises(FileExistsError, match="new path for each export"):
        export_for_serving(emb, path)
    with pytest.raises(TypeError, match="must be a unison.DynamicEmbedding"):
        export_for_serving(torch.nn.Embedding(3, 4), tmp_path / "x")
    with pytest.raises(FileNotFoundError, match="no serving export"):
        ServingEmbedding.load(tmp_path / "nothing")
    with pytest.raises(TypeError, match="`default` must be a number"):
        ServingEmbedding.load(path, default="zero")
    train(emb, opt, 1, seed=0)
    delta = export_for_serving(emb, tmp_path / "1", delta=True)
    with pytest.raises(ValueError, match="load that chain's full export"):
        ServingEmbedding.load(delta)
    (delta / "rows.bin").write_bytes(b"\0" * 3)
    served = ServingEmbedding.load(path)
    with pytest.raises(ValueError, match="holds 3 bytes.*damaged"):
        served.apply_delta(delta)


def test_lookups_go_on_while_deltas_land(tmp_path):
    emb, opt = make()
    train(emb, opt, 2, seed=0)
    served = ServingEmbedding.load(export_for_serving(emb, tmp_path / "0"))
    deltas = []
    for k in range(1, 6):
        train(emb, opt, 2, seed=k)
        deltas.append(export_for_serving(emb, tmp_path / str(k), delta=True))
    stop, errors, lookups = threading.Event(), [], [0]

    def serve() -> None:
        g = torch.Generator().manual_seed(1)
        while not stop.is_set():
            try:
                out = served(torch.randint(0, 1000, (64, 3), generator=g))
                assert out.shape == (64, 4) and torch.isfinite(out).all()
                lookups[0] += 1
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
                return

    readers = [threading.Thread(target=serve) for _ in range(2)]
    for t in readers:
        t.start()
    for path in deltas:
        served.apply_delta(path)
    stop.set()
    for t in readers:
        t.join(30)
    assert not errors and lookups[0] > 0
    assert_serves(served, emb)


def test_deltas_read_ahead_apply_in_order_and_a_stale_read_is_refused(tmp_path):
    """read_delta checks a delta against a number the table will reach, changing nothing; apply_read_delta
    applies it only at that number (what ServingFollower does to check a poll's deltas before any applies)."""
    emb, opt = make()
    train(emb, opt, 2, seed=0)
    served = ServingEmbedding.load(export_for_serving(emb, tmp_path / "0"))
    paths = []
    for k in (1, 2):
        train(emb, opt, 2, seed=k)
        paths.append(export_for_serving(emb, tmp_path / str(k), delta=True))
    before = served._rows_of(torch.arange(-5, 20000)).clone()
    first = served.read_delta(paths[0])
    second = served.read_delta(paths[1], after=first.number)
    with pytest.raises(ValueError, match="export 1 -> 2 .* at export 0: it is out of order"):
        served.read_delta(paths[1])
    assert served.number == 0 and torch.equal(served._rows_of(torch.arange(-5, 20000)), before)
    with pytest.raises(ValueError, match="follows export 1, this table is at export 0; nothing was changed"):
        served.apply_read_delta(second)
    served.apply_read_delta(first)
    with pytest.raises(ValueError, match="follows export 0, this table is at export 1"):
        served.apply_read_delta(first)
    served.apply_read_delta(second)
    assert served.number == 2
    assert_serves(served, emb)
