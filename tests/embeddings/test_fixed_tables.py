"""``unison.embeddings.on_ps`` / ``tables_on_ps``: fixed tables become row tables with the same rows."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import unison
from unison import DynamicEmbedding
from unison.embeddings import on_ps, tables_on_ps


def _train(module, batches, **bag):
    opt = torch.optim.Adagrad(module.parameters(), lr=0.1)
    for ids, target in batches:
        loss = F.mse_loss(module(ids, **bag).sum(-1), target)
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.mark.parametrize("make", [lambda: nn.Embedding(40, 4), lambda: nn.EmbeddingBag(40, 4, mode="mean")],
                         ids=["Embedding", "EmbeddingBag-mean"])
def test_the_rows_and_their_training_are_the_fixed_tables(make):
    torch.manual_seed(0)
    fixed = make()
    torch.manual_seed(0)
    rows = on_ps(make())
    assert isinstance(rows, DynamicEmbedding) and rows.num_embeddings == 40 and rows.num_rows == 40
    assert torch.equal(rows.state_dict()["rows"], fixed.weight.detach())
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 40, (5, 3), generator=g), torch.randn(5, 3, generator=g)) for _ in range(4)]
    if isinstance(fixed, nn.EmbeddingBag):
        batches = [(ids, target.sum(1)) for ids, target in batches]
    _train(fixed, batches)
    _train(rows, batches)
    torch.testing.assert_close(rows.state_dict()["rows"], fixed.weight.detach(), rtol=1e-5, atol=1e-6)
    with pytest.raises(IndexError, match=r"\[0, 40\)"):
        rows(torch.tensor([[40]]))


def test_a_size_threshold_selects_the_tables_and_options_without_equivalent_are_refused():
    model = nn.ModuleDict({"users": nn.Embedding(1000, 8), "tiny": nn.Embedding(4, 8),
                           "tower": nn.Sequential(nn.EmbeddingBag(500, 8, mode="sum"), nn.Linear(8, 1))})
    assert tables_on_ps(model, min_bytes=500 * 8 * 4) == ["users", "tower.0"]
    assert isinstance(model["users"], DynamicEmbedding) and isinstance(model["tower"][0], DynamicEmbedding)
    assert isinstance(model["tiny"], nn.Embedding)
    with pytest.raises(ValueError, match="padding_idx"):
        on_ps(nn.Embedding(10, 2, padding_idx=0))
    with pytest.raises(ValueError, match="'max'"):
        on_ps(nn.EmbeddingBag(10, 2, mode="max"))
    with pytest.raises(TypeError, match="not an nn.Embedding"):
        on_ps(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="min_bytes"):
        tables_on_ps(model, min_bytes=-1)


def test_one_device_strategy_keeps_the_rows_in_this_process():
    with unison.OneDeviceStrategy("cpu:0").scope():
        rows = on_ps(nn.Embedding(6, 2))
    assert rows.table_stats() == [{"ps": 0, "rows": 6, "bytes": rows.table.bytes}]
