"""Online serving of a model whose rows and dense layers live on 2 ps tasks: after an explicit poll the
follower serves the rows the ps tasks hold at that snapshot, and the dense layers' values."""

from __future__ import annotations

import json

import pytest
import torch

from tests.ps._cluster import ps_cluster
from tests.ps.test_dynamic_tables_on_ps import _batches, _cluster_model, _train_step
from unison._embeddings.tables.eviction import EvictUnseen
from unison.embeddings import ServingExporter, ServingFollower


@pytest.mark.timeout(120)
def test_after_each_poll_the_follower_serves_the_rows_on_the_ps_tasks_and_the_dense_values(tmp_path):
    with ps_cluster(1, 2) as cluster:
        strategy, coordinator, model, opt = _cluster_model(cluster, 1, 2, eviction=EvictUnseen(2), lr=0.3)
        step = _train_step(model, opt)
        exporter = ServingExporter(tmp_path, {"rows": model.rows}, dense=model, every_seconds=60)
        follower = ServingFollower(tmp_path)

        def train(seed: int) -> None:
            for ids, target in _batches(4, seed=seed, batch=4):
                coordinator.schedule(step, args=(ids, target)).fetch()

        def assert_serves() -> None:
            want = model.state_dict()
            served = follower.embeddings["rows"]
            assert served.num_rows == want["rows.ids"].numel() > 0
            assert torch.equal(served._rows_of(want["rows.ids"]), want["rows.rows"])
            assert follower.dense_state is not None and sorted(follower.dense_state) == ["head.bias", "head.weight"]
            for key, value in follower.dense_state.items():
                assert torch.equal(value, torch.as_tensor(want[key]).detach()), key

        train(0)
        exporter.export()
        assert [s.kind for s in follower.poll()] == ["full"]
        assert_serves()
        removed = 0
        for seed in (1, 2):  # rows change, come and are evicted on the ps tasks between two snapshots
            train(seed)
            manifest = json.loads((exporter.export() / "embeddings" / "rows" / "manifest.json").read_text())
            removed += manifest["arrays"]["removed"]["shape"][0]
        assert removed > 0  # evicted rows travel as tombstones
        assert [(s.number, s.kind) for s in follower.poll()] == [(1, "delta"), (2, "delta")]
        assert_serves()
        coordinator.shutdown()
