"""``unison.DynamicEmbedding`` on one device: rows made on first touch, trained by the optimizer that holds it.

The reference for every training check is a plain ``nn.Embedding`` / ``nn.EmbeddingBag``
holding the same rows (the initializer's rows of the ids used, in the order of a sorted
id list) and trained by the same torch optimizer.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import unison
from unison import DynamicEmbedding
from unison.embeddings import EvictUnseen, Normal

pytestmark = pytest.mark.timeout(60)

DIM = 6
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _batches(steps: int = 6, shape: tuple[int, ...] = (8, 3)) -> list[torch.Tensor]:
    """Feature ids from a small pool spanning the whole int64 range (negative ones too)."""
    pool = torch.tensor([INT64_MIN, INT64_MAX, -1, 0, 1, 2**40 + 3, -(2**50), 12345, -987654321, 77])
    g = torch.Generator().manual_seed(0)
    return [pool[torch.randint(0, len(pool), shape, generator=g)] for _ in range(steps)]


def _reference(emb: DynamicEmbedding, ids: torch.Tensor, bag: str | None = None) -> tuple[nn.Module, torch.Tensor]:
    """A plain embedding holding the initial rows of ``ids``'s distinct values, and the map id -> index."""
    vocabulary = torch.unique(ids)
    rows = emb.table.lookup(vocabulary, create=False)
    plain = nn.EmbeddingBag(len(vocabulary), DIM, mode=bag) if bag else nn.Embedding(len(vocabulary), DIM)
    with torch.no_grad():
        plain.weight.copy_(rows)
    return plain, vocabulary


def _indices(vocabulary: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.searchsorted(vocabulary, ids)


def test_rows_of_any_int64_id_are_made_on_first_touch_from_the_id_alone():
    emb = DynamicEmbedding(DIM, initializer=Normal(0.0, 0.5), seed=3)
    ids = torch.tensor([[INT64_MIN, -1, INT64_MAX], [0, -1, 42]])
    out = emb(ids)
    assert out.shape == (2, 3, DIM) and emb.num_rows == 5
    assert torch.equal(out[0, 1], out[1, 1])  # one row per id
    other = DynamicEmbedding(DIM, initializer=Normal(0.0, 0.5), seed=3)
    assert torch.equal(other(ids.flip(0).flip(1)), out.flip(0).flip(1))  # creation order changes nothing
    assert not torch.equal(DynamicEmbedding(DIM, initializer=Normal(0.0, 0.5), seed=4)(ids), out)


def test_evaluation_reads_rows_without_making_them():
    emb = DynamicEmbedding(DIM).eval()
    with torch.no_grad():
        emb(torch.tensor([5, 6]))
    assert emb.num_rows == 0


@pytest.mark.parametrize("make_opt", [lambda p: torch.optim.SGD(p, lr=0.3),
                                      lambda p: torch.optim.Adagrad(p, lr=0.2, initial_accumulator_value=0.1)],
                         ids=["sgd", "adagrad"])
def test_training_equals_a_plain_embedding_with_the_same_rows(make_opt):
    batches = _batches()
    emb = DynamicEmbedding(DIM)
    plain, vocabulary = _reference(emb, torch.cat([b.reshape(-1) for b in batches]))
    head, plain_head = nn.Linear(DIM, 1), nn.Linear(DIM, 1)
    plain_head.load_state_dict(head.state_dict())
    opt = make_opt([*emb.parameters(), *head.parameters()])
    plain_opt = make_opt([*plain.parameters(), *plain_head.parameters()])
    for ids in batches:
        opt.zero_grad()
        head(emb(ids)).square().mean().backward()
        opt.step()
        plain_opt.zero_grad()
        plain_head(plain(_indices(vocabulary, ids))).square().mean().backward()
        plain_opt.step()
    torch.testing.assert_close(emb.table.lookup(vocabulary, create=False), plain.weight.detach(), rtol=0, atol=1e-6)
    torch.testing.assert_close(head.weight, plain_head.weight, rtol=0, atol=1e-6)
    assert emb.num_rows == len(vocabulary)


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_bags_pool_as_embedding_bag_with_offsets_and_weights(mode):
    ids = torch.tensor([INT64_MAX, -4, 9, -4, 0, INT64_MIN])
    offsets = torch.tensor([0, 2, 3])
    weights = torch.tensor([0.5, 2.0, 1.0, -1.0, 3.0, 0.25]) if mode == "sum" else None
    emb = DynamicEmbedding(DIM, mode=mode)
    plain, vocabulary = _reference(emb, ids, bag=mode)
    opt, plain_opt = torch.optim.SGD(emb.parameters(), lr=0.5), torch.optim.SGD(plain.parameters(), lr=0.5)
    for _ in range(3):
        out = emb(ids, offsets, per_sample_weights=weights)
        want = plain(_indices(vocabulary, ids), offsets, per_sample_weights=weights)
        torch.testing.assert_close(out, want, rtol=0, atol=1e-6)
        opt.zero_grad(), plain_opt.zero_grad()
        out.pow(3).sum().backward()
        want.pow(3).sum().backward()
        opt.step(), plain_opt.step()
    two_d = DynamicEmbedding(DIM, mode=mode)
    assert two_d(torch.tensor([[1, 2], [3, 1]])).shape == (2, DIM)


def test_backward_passes_before_a_step_accumulate_as_gradients_do():
    ids = torch.tensor([3, -3, 3])
    emb, once = DynamicEmbedding(DIM), DynamicEmbedding(DIM)
    opt, once_opt = torch.optim.SGD(emb.parameters(), lr=0.1), torch.optim.SGD(once.parameters(), lr=0.1)
    emb(ids[:2]).sum().backward()
    emb(ids[2:]).sum().backward()
    opt.step()
    once(ids).sum().backward()
    once_opt.step()
    assert torch.equal(emb.table.export()["rows"], once.table.export()["rows"])


def test_a_checkpoint_holds_the_rows_that_exist_and_training_goes_on_from_it(tmp_path):
    batches = _batches(steps=8)
    emb = DynamicEmbedding(DIM)
    opt = torch.optim.Adagrad(emb.parameters(), lr=0.1)
    for ids in batches[:4]:
        opt.zero_grad(), emb(ids).sum().backward(), opt.step()
    torch.save(emb.state_dict(), tmp_path / "emb.pt")
    restored = DynamicEmbedding(DIM)
    restored.load_state_dict(torch.load(tmp_path / "emb.pt", weights_only=False))
    assert restored.num_rows == emb.num_rows
    assert sorted(emb.state_dict()) == ["_extra_state", "counts", "ids", "last_seen", "rows", "state.sum"]
    restored_opt = torch.optim.Adagrad(restored.parameters(), lr=0.1)
    for ids in batches[4:]:
        for module, optimizer in ((emb, opt), (restored, restored_opt)):
            optimizer.zero_grad(), module(ids).sum().backward(), optimizer.step()
    assert torch.equal(restored.table.export()["rows"], emb.table.export()["rows"])


def test_eviction_after_each_step_removes_the_rows_unseen_for_longer_than_the_policy_allows():
    emb = DynamicEmbedding(DIM, eviction=EvictUnseen(2))
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    for ids in ([1, 2], [2], [2], [2]):
        opt.zero_grad(), emb(torch.tensor(ids)).sum().backward(), opt.step()
    assert emb.table.export()["ids"].tolist() == [2]


def test_bad_input_and_unsupported_optimizers_are_refused_with_the_fix():
    emb = DynamicEmbedding(DIM)
    with pytest.raises(TypeError, match="int64"):
        emb(torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="mode='sum'"):
        emb(torch.tensor([1, 2]), torch.tensor([0]))
    with pytest.raises(ValueError, match="`mode`"):
        DynamicEmbedding(DIM, mode="max")
    opt = torch.optim.RMSprop(emb.parameters(), lr=0.1)
    emb(torch.tensor([1])).sum().backward()
    with pytest.raises(ValueError, match="Adagrad"):
        opt.step()
    kept = DynamicEmbedding(DIM)
    momentum = torch.optim.SGD(kept.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="no momentum"):
        momentum.step()


def test_one_device_strategy_trains_it_and_in_process_replicas_refuse_it():
    strategy = unison.OneDeviceStrategy("cpu:0")
    with strategy.scope():
        emb = DynamicEmbedding(DIM)
        opt = torch.optim.SGD(emb.parameters(), lr=0.1)

    def step(ids):
        opt.zero_grad()
        loss = emb(ids).sum()
        loss.backward()
        opt.step()
        return loss

    before = emb.table.lookup(torch.tensor([5]), create=False)
    strategy.run(step, args=(torch.tensor([5, 6]),))
    torch.testing.assert_close(emb.table.lookup(torch.tensor([5]), create=False), before - 0.1)
    with (unison.MirroredStrategy(["cpu:0", "cpu:1"]).scope(),
          pytest.raises(NotImplementedError, match="ParameterServerStrategy")):
        DynamicEmbedding(DIM)


def test_a_row_counts_every_occurrence_of_its_id_in_a_batch():
    emb = DynamicEmbedding(DIM, mode="sum")
    emb(torch.tensor([[7, 7, 7], [7, -2, 5]]))
    state = emb.state_dict()
    counts = dict(zip(state["ids"].tolist(), state["counts"].tolist()))
    assert counts == {-2: 1, 5: 1, 7: 4}


def test_row_wise_adagrad_keeps_one_accumulator_per_row():
    emb = DynamicEmbedding(4, row_wise_adagrad=True, initializer=unison._embeddings.tables.initializers.zeros())
    opt = torch.optim.Adagrad(emb.parameters(), lr=0.5)
    grad = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    (emb(torch.tensor([9])) * grad).sum().backward()
    opt.step()
    state = emb.state_dict()
    assert state["state.rowwise_sum"].shape == (1, 1) and "state.sum" not in state
    accumulator = grad.square().mean()
    torch.testing.assert_close(state["state.rowwise_sum"], accumulator.reshape(1, 1))
    torch.testing.assert_close(state["rows"], -0.5 * grad / (accumulator.sqrt() + 1e-10))


def _plain_sparse(emb: DynamicEmbedding, vocabulary: torch.Tensor) -> nn.Embedding:
    """An ``nn.Embedding(sparse=True)`` holding the initial rows of ``vocabulary``."""
    plain = nn.Embedding(len(vocabulary), DIM, sparse=True)
    with torch.no_grad():
        plain.weight.copy_(emb.table.lookup(vocabulary, create=False))
    return plain


def _late_batches() -> list[torch.Tensor]:
    """Batches in which some ids first appear at a later step and some steps leave ids out."""
    return [torch.tensor(ids) for ids in ([[7, -1], [7, 7]], [[INT64_MAX, 7]], [[3, 3]],
                                          [[INT64_MIN, -1], [3, 7]], [[INT64_MAX, INT64_MAX]], [[-1, 5]])]


def test_sparse_adam_rows_equal_sparse_adam_on_a_sparse_embedding():
    batches = _late_batches()
    emb = DynamicEmbedding(DIM)
    vocabulary = torch.unique(torch.cat([b.reshape(-1) for b in batches]))
    plain = _plain_sparse(emb, vocabulary)
    head, plain_head = nn.Linear(DIM, 1), nn.Linear(DIM, 1)
    plain_head.load_state_dict(head.state_dict())
    hyper = {"lr": 0.05, "betas": (0.8, 0.95), "eps": 1e-6}
    rows_opt, dense_opt = torch.optim.SparseAdam(emb.parameters(), **hyper), torch.optim.Adam(head.parameters())
    plain_opts = torch.optim.SparseAdam(plain.parameters(), **hyper), torch.optim.Adam(plain_head.parameters())
    for ids in batches:
        for opt in (rows_opt, dense_opt, *plain_opts):
            opt.zero_grad()
        head(emb(ids)).pow(3).mean().backward()
        plain_head(plain(_indices(vocabulary, ids))).pow(3).mean().backward()
        for opt in (rows_opt, dense_opt, *plain_opts):
            opt.step()
    state, moments = emb.state_dict(), plain_opts[0].state[plain.weight]
    assert torch.equal(state["ids"], vocabulary) and moments["step"] == len(batches)
    torch.testing.assert_close(state["rows"], plain.weight.detach(), rtol=0, atol=1e-6)
    torch.testing.assert_close(state["state.exp_avg"], moments["exp_avg"], rtol=0, atol=1e-6)
    torch.testing.assert_close(state["state.exp_avg_sq"], moments["exp_avg_sq"], rtol=0, atol=1e-6)
    assert state["_extra_state"]["step"] == len(batches)  # t, one per opt.step(), kept by the table
    torch.testing.assert_close(head.weight, plain_head.weight, rtol=0, atol=1e-6)


def test_a_row_made_again_after_eviction_starts_with_zero_moments_at_the_current_step():
    emb = DynamicEmbedding(DIM, eviction=EvictUnseen(1))
    vocabulary = torch.tensor([1, 2])
    plain = _plain_sparse(emb, vocabulary)
    opt, plain_opt = torch.optim.SparseAdam(emb.parameters(), lr=0.1), torch.optim.SparseAdam(plain.parameters(),
                                                                                              lr=0.1)
    for step, ids in enumerate(([1, 2], [2], [2], [1, 2], [1, 2]), 1):
        if step == 4:  # id 1 was evicted after step 2: it comes back as a new row, its moments zero
            assert emb.table.export()["ids"].tolist() == [2]
            with torch.no_grad():
                plain.weight[0] = emb.table.lookup(torch.tensor([1]), create=False)[0]
                for name in ("exp_avg", "exp_avg_sq"):
                    plain_opt.state[plain.weight][name][0] = 0.0
        grad = torch.arange(1.0, DIM * len(ids) + 1).reshape(len(ids), DIM) / step
        opt.zero_grad(), plain_opt.zero_grad()
        (emb(torch.tensor(ids)) * grad).sum().backward()
        (plain(_indices(vocabulary, torch.tensor(ids))) * grad).sum().backward()
        opt.step(), plain_opt.step()
    assert emb.num_rows == 2
    torch.testing.assert_close(emb.table.lookup(vocabulary, create=False), plain.weight.detach(), rtol=0, atol=1e-6)


def test_sparse_adam_goes_on_from_a_checkpoint_with_its_step_count(tmp_path):
    batches = _late_batches()
    emb = DynamicEmbedding(DIM)
    opt = torch.optim.SparseAdam(emb.parameters(), lr=0.1)
    for ids in batches[:3]:
        opt.zero_grad(), emb(ids).pow(2).sum().backward(), opt.step()
    torch.save(emb.state_dict(), tmp_path / "emb.pt")
    restored = DynamicEmbedding(DIM)
    restored.load_state_dict(torch.load(tmp_path / "emb.pt", weights_only=False))
    assert restored.table.current_step == 3
    restored_opt = torch.optim.SparseAdam(restored.parameters(), lr=0.1)  # a new optimizer: t is the table's
    for ids in batches[3:]:
        for module, optimizer in ((emb, opt), (restored, restored_opt)):
            optimizer.zero_grad(), module(ids).pow(2).sum().backward(), optimizer.step()
    ours, theirs = restored.state_dict(), emb.state_dict()
    for key in ("ids", "rows", "state.exp_avg", "state.exp_avg_sq"):
        assert torch.equal(ours[key], theirs[key]), key


@pytest.mark.parametrize("dense_adam", [torch.optim.Adam, torch.optim.AdamW])
def test_adam_over_a_table_is_refused_naming_sparse_adam_and_nothing_moves(dense_adam):
    emb, head = DynamicEmbedding(DIM), nn.Linear(DIM, 1)
    opt = dense_adam([*head.parameters(), *emb.parameters()], lr=0.1)
    head(emb(torch.tensor([4, 5]))).sum().backward()
    before, head_before = emb.state_dict(), head.weight.detach().clone()
    with pytest.raises(ValueError, match=rf"{dense_adam.__name__}.*did not touch.*fix: .*torch\.optim\.SparseAdam"):
        opt.step()
    after = emb.state_dict()
    assert torch.equal(after["rows"], before["rows"]) and after["_extra_state"]["step"] == 0
    assert torch.equal(head.weight, head_before) and not opt.state


def test_a_compiled_model_runs_the_table_eagerly_and_trains_as_eager():
    """``torch.compile`` leaves the table's forward to eager PyTorch (a graph break: its ids, numpy
    index and hooks are not traceable); the dense layers around it compile and train alike."""

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = DynamicEmbedding(DIM, seed=1)
            self.dense = nn.Linear(DIM, 1)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.dense(torch.tanh(self.emb(ids))).sum()

    results = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = Model()
        run = torch.compile(model, backend="eager") if compiled else model
        opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
        losses = []
        for ids in _batches(steps=4, shape=(16, 3)):
            opt.zero_grad()
            loss = run(ids)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        every = torch.unique(torch.cat([b.reshape(-1) for b in _batches(steps=4, shape=(16, 3))]))
        results.append((losses, model.emb.table.lookup(every, create=False), model.dense.weight.detach().clone()))
    (eager_losses, eager_rows, eager_w), (compiled_losses, compiled_rows, compiled_w) = results
    assert compiled_losses == eager_losses
    assert torch.equal(compiled_rows, eager_rows) and torch.equal(compiled_w, eager_w)
    assert eager_losses[0] != eager_losses[-1]  # it trained
