"""Delta checkpoints of a DynamicEmbedding on one device: a full save point and its deltas in order give
the table a full checkpoint at the last delta would (evictions, admission and optimizer state included),
and a delta of another table, out of order or applied twice is refused, changing nothing."""

from __future__ import annotations

import copy

import pytest
import torch

import unison
from unison._embeddings.optim.row_optimizers import RowAdagrad
from unison._embeddings.tables.local_table import LocalTable
from unison.embeddings import AdmitAfter, EvictUnseen

pytestmark = pytest.mark.timeout(120)

SMALL_SKETCH = {"sketch_width": 4096, "sketch_depth": 4}
CHAIN = ("table_id", "sequence", "exact", "base")
COMPARED = ("ids", "rows", "counts", "last_seen", "pending_counts")


def make(**policies) -> tuple[unison.DynamicEmbedding, torch.optim.Optimizer]:
    emb = unison.DynamicEmbedding(4, mode="sum", seed=3, initializer=unison.embeddings.Uniform(-0.5, 0.5),
                                  **policies)
    return emb, torch.optim.Adagrad(emb.parameters(), lr=0.1)


def train(emb: unison.DynamicEmbedding, opt: torch.optim.Optimizer, steps: int, seed: int, vocab: int = 400) -> None:
    """Batches from a drifting vocabulary: old ids stop coming (evicted), new ones start."""
    g = torch.Generator().manual_seed(seed)
    for i in range(steps):
        ids = torch.randint(0, vocab, (32, 3), generator=g) + 37 * (seed * steps + i)
        opt.zero_grad()
        emb(ids).pow(2).sum().backward()
        opt.step()


def assert_same_table(got: dict, want: dict) -> None:
    """Equal ids, rows, optimizer state, counts, last-seen steps, admission sketch and step (clocks excluded)."""
    for key in COMPARED:
        assert (key in got) == (key in want), key
        if key in want:
            assert torch.equal(got[key], want[key]), key
    states = sorted(k for k in want if k.startswith("state."))
    assert states and sorted(k for k in got if k.startswith("state.")) == states
    assert all(torch.equal(got[k], want[k]) for k in states)
    meta = {k: v for k, v in got["_extra_state"].items() if k not in CHAIN}
    assert meta == {k: v for k, v in want["_extra_state"].items() if k not in CHAIN}


@pytest.mark.parametrize("policies", [
    {"eviction": EvictUnseen(3)},
    {"eviction": EvictUnseen(2), "admission": AdmitAfter(2, **SMALL_SKETCH), "capacity": 600},
])
def test_a_full_save_and_its_deltas_in_order_equal_a_full_save_at_the_last_delta(policies):
    emb, opt = make(**policies)
    train(emb, opt, 5, seed=0)
    full = emb.delta_state_dict(full=True)
    assert full["_extra_state"]["sequence"] == 1 and full["_extra_state"]["exact"]
    deltas = []
    for seed in (1, 2, 3):
        train(emb, opt, 4, seed=seed)
        deltas.append(emb.delta_state_dict())
    assert [d["_extra_state"]["base"] for d in deltas] == [1, 2, 3]
    assert sum(d["removed"].numel() for d in deltas) > 0  # evictions travel as tombstones
    assert deltas[-1]["ids"].numel() < emb.num_rows + deltas[-1]["removed"].numel()
    want = emb.state_dict()

    restored, _ = make(**policies)
    restored.load_state_dict(full)
    for delta in deltas:
        restored.load_delta_state_dict(delta)
    assert_same_table(restored.state_dict(), want)
    assert restored.state_dict()["_extra_state"]["sequence"] == 4
    # the restored table goes on training and saving as the original does
    train(emb, opt, 3, seed=9)
    opt_restored = torch.optim.Adagrad(restored.parameters(), lr=0.1)
    opt_restored.load_state_dict(opt.state_dict())
    train(restored, opt_restored, 3, seed=9)
    assert_same_table(restored.delta_state_dict(), emb.delta_state_dict())


def test_an_evicted_id_that_comes_back_is_in_the_delta_not_in_its_tombstones():
    table = LocalTable(2, seed=1, eviction=EvictUnseen(1))
    opt = RowAdagrad(0.1, initial_accumulator_value=0.1)
    table.push(torch.tensor([5, 6]), torch.ones(2, 2), opt)
    table.export_delta(full=True)
    for _ in range(3):
        table.push(torch.tensor([6]), torch.ones(1, 2), opt)  # 5 goes
    table.push(torch.tensor([5, 7]), torch.ones(2, 2), opt)  # and comes back; 7 is new
    for _ in range(2):
        table.push(torch.tensor([5, 6]), torch.ones(2, 2), opt)  # 7 goes again
    delta = table.export_delta()
    assert delta["removed"].tolist() == [7]
    assert set(delta["ids"].tolist()) == {5, 6}


def test_a_refused_delta_names_both_and_changes_nothing():
    emb, opt = make(eviction=EvictUnseen(3))
    train(emb, opt, 3, seed=0)
    full = emb.delta_state_dict(full=True)
    train(emb, opt, 2, seed=1)
    first = emb.delta_state_dict()
    train(emb, opt, 2, seed=2)
    second = emb.delta_state_dict()

    restored, _ = make(eviction=EvictUnseen(3))
    restored.load_state_dict(full)
    before = copy.deepcopy(restored.state_dict())
    table_id = full["_extra_state"]["table_id"]
    with pytest.raises(ValueError, match=r"from save 2 to 3 .* at save 1: it is out of order.*nothing was changed"):
        restored.load_delta_state_dict(second)
    other, other_opt = make(eviction=EvictUnseen(3))
    train(other, other_opt, 2, seed=5)
    other.delta_state_dict(full=True)
    train(other, other_opt, 1, seed=6)
    with pytest.raises(ValueError, match=rf"delta is of table '\w+' .* this table is '{table_id}'"):
        restored.load_delta_state_dict(other.delta_state_dict())
    assert_same_table(restored.state_dict(), before)
    restored.load_delta_state_dict(first)
    with pytest.raises(ValueError, match="from save 1 to 2 .* at save 2: it was already applied"):
        restored.load_delta_state_dict(first)
    with pytest.raises(ValueError, match="not a delta .* load_state_dict"):
        restored.load_delta_state_dict(full)
    restored.load_delta_state_dict(second)
    assert_same_table(restored.state_dict(), emb.state_dict())


def test_a_delta_needs_a_full_save_point_and_an_exact_one():
    emb, opt = make()
    train(emb, opt, 2, seed=0)
    with pytest.raises(ValueError, match=r"no save point yet.*delta_state_dict\(full=True\)"):
        emb.delta_state_dict()
    emb.delta_state_dict(full=True)
    train(emb, opt, 2, seed=1)
    between = emb.state_dict()  # a full checkpoint taken between save points
    assert between["_extra_state"]["exact"] is False
    train(emb, opt, 2, seed=2)
    delta = emb.delta_state_dict()
    loaded, _ = make()
    loaded.load_state_dict(between)
    with pytest.raises(ValueError, match=r"taken after save 1.*apply the delta that follows save 1"):
        loaded.delta_state_dict()
    loaded.load_delta_state_dict(delta)  # rows of the full one that changed again are replaced: the same table
    assert_same_table(loaded.state_dict(), emb.state_dict())
    loaded.delta_state_dict()  # exact again: its own deltas go on


def test_a_table_without_deltas_keeps_no_removal_log():
    table = LocalTable(2, seed=1, eviction=EvictUnseen(1))
    opt = RowAdagrad(0.1, initial_accumulator_value=0.1)
    for i in range(20):
        table.push(torch.tensor([i]), torch.ones(1, 2), opt)
    assert table._removed_log == []
    table.export_delta(full=True)
    for i in range(20, 25):
        table.push(torch.tensor([i]), torch.ones(1, 2), opt)
    assert len(table._removed_log) > 0
    table.export_delta()
    assert table._removed_log == []
