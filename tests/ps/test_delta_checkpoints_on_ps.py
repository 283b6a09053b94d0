"""Delta checkpoints and serving exports of a table on ps tasks: gathered from 2 ps tasks, a full save point
and its deltas load onto 3 ps tasks and onto one device as the full checkpoint at the last delta; a refused
delta changes no shard; a serving export gathered from the ps tasks serves their rows."""

from __future__ import annotations

import pytest
import torch

from tests.ps._cluster import ps_cluster
from tests.ps.test_dynamic_tables_on_ps import Ranker, _batches, _cluster_model, _train_step
from unison._embeddings.tables.eviction import EvictUnseen
from unison.embeddings import ServingEmbedding, export_for_serving

TABLE_KEYS = ("rows.ids", "rows.rows", "rows.state.sum", "rows.counts", "rows.last_seen")


def _assert_table(got: dict, want: dict) -> None:
    for key in TABLE_KEYS:
        assert torch.equal(got[key], want[key]), key
    assert got["rows._extra_state"]["step"] == want["rows._extra_state"]["step"]


@pytest.mark.timeout(120)
def test_full_and_deltas_from_two_ps_load_onto_three_ps_and_one_device_and_serve(tmp_path):
    with ps_cluster(1, 2) as cluster:
        strategy, coordinator, model, opt = _cluster_model(cluster, 1, 2, eviction=EvictUnseen(2), lr=0.3)
        step = _train_step(model, opt)

        def train(seed: int) -> None:
            for ids, target in _batches(4, seed=seed, batch=4):
                coordinator.schedule(step, args=(ids, target)).fetch()

        train(0)
        full = model.rows.delta_state_dict(full=True)
        export_for_serving(model.rows, tmp_path / "serve-0")
        deltas = []
        for seed in (1, 2):
            train(seed)
            deltas.append(model.rows.delta_state_dict())
        assert sum(d["removed"].numel() for d in deltas) > 0  # rows evicted on the ps tasks travel as tombstones
        export_for_serving(model.rows, tmp_path / "serve-1", delta=True)
        want = model.state_dict()
        with pytest.raises(ValueError, match="from save 2 to 3 .* at save 3: it was already applied"):
            model.rows.load_delta_state_dict(deltas[1])
        _assert_table(model.state_dict(), want)
        coordinator.shutdown()

    served = ServingEmbedding.load(tmp_path / "serve-0")
    assert served.mode == "sum" and served.num_rows == full["ids"].numel()
    assert torch.equal(served._rows_of(full["ids"]), full["rows"])
    served.apply_delta(tmp_path / "serve-1")
    assert served.num_rows == want["rows.ids"].numel()
    assert torch.equal(served._rows_of(want["rows.ids"]), want["rows.rows"])

    with ps_cluster(1, 3) as cluster:
        strategy, coordinator, model3, _ = _cluster_model(cluster, 1, 3, eviction=EvictUnseen(2), lr=0.3)
        model3.rows.load_state_dict(full)
        before = model3.state_dict()
        with pytest.raises(ValueError, match="from save 2 to 3 .* at save 1: it is out of order"):
            model3.rows.load_delta_state_dict(deltas[1])
        _assert_table(model3.state_dict(), before)  # no shard changed
        for delta in deltas:
            model3.rows.load_delta_state_dict(delta)
        _assert_table(model3.state_dict(), want)
        coordinator.shutdown()

    local = Ranker(EvictUnseen(2))
    local.rows.load_state_dict(full)
    for delta in deltas:
        local.rows.load_delta_state_dict(delta)
    _assert_table(local.state_dict(), want)
