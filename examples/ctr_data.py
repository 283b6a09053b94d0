"""A synthetic click-through data set with the Criteo Kaggle schema: 13 dense, 26 categorical features.

Criteo's own data cannot ship with the repository, so the recommendation example and
benchmark draw a stand-in with its shape: 13 log1p-transformed counts, 26 categorical
features whose values are 64-bit hashes over the whole int64 range (negative ones
included), each feature with its own vocabulary size (a few values to about a million)
and a power-law popularity (a few ids very frequent, most rare), and a ~25% click rate.

How a sample is made. Feature ``f``'s rank ``r`` is drawn from a truncated power law
over ``[0, vocab_f)`` (exponent ``zipf``, by inverse CDF) and its id is
``splitmix64(f << 40 | r)``. Clicks follow a hidden logistic model that is the same for
every seed, so a model trained on one seed's data is judged on another's: each id has a
weight counted from its hash (a normal draw, larger for frequent ranks, so what can be
learnt from a few epochs dominates), the dense features add a linear and a quadratic
term, and three pairs of small categorical features add pairwise effects. The true click
probabilities are kept (``CtrData.probabilities``), so :func:`bayes_auc` gives the best
AUC any model can reach.

Fixed-size tables (``nn.EmbeddingBag``, TensorFlow, TorchRec) map ids with
:func:`hashed_to_rows`; a dynamic table takes the ids as they are.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator

import torch

from unison._embeddings.tables.id_hashing import splitmix64

__all__ = ["NUM_DENSE", "NUM_SPARSE", "CtrData", "vocab_sizes", "make_ctr_data", "hashed_to_rows", "auc",
           "bayes_auc"]

NUM_DENSE = 13
NUM_SPARSE = 26

# Criteo Kaggle's cardinalities (C1..C26), the four above a million capped near one million.
_CRITEO_VOCAB = (1460, 583, 1_000_000, 600_000, 305, 24, 12517, 633, 3, 93145, 5683, 900_000, 3194, 27, 14992,
                 700_000, 10, 5652, 2173, 4, 800_000, 18, 15, 286181, 105, 142572)

# The hidden model: fixed constants, the same for every data seed.
_MODEL_SALT = 0x5EED_C11C
_FEATURE_SCALE = (0.35, 0.30, 0.45, 0.40, 0.25, 0.30, 0.30, 0.25, 0.20, 0.35, 0.30, 0.45, 0.25, 0.25, 0.30,
                  0.40, 0.20, 0.30, 0.25, 0.20, 0.40, 0.25, 0.25, 0.35, 0.25, 0.35)
_RANK_DECAY = 0.15  # an id's weight scale shrinks as (1 + rank) ** -decay: frequent ids matter most
_PAIRS = ((5, 16), (8, 19), (13, 22))  # small features whose combination has its own effect
_PAIR_SCALE = 0.35
_DENSE_MU = (0.5, 1.5, 1.0, 1.8, 6.0, 3.0, 1.5, 2.5, 3.5, 0.3, 1.0, 0.2, 2.0)
_DENSE_SIGMA = (1.0, 1.5, 1.2, 1.0, 2.0, 1.6, 1.4, 1.2, 1.5, 0.8, 1.0, 0.8, 1.3)
_DENSE_LINEAR = (0.25, -0.15, 0.0, 0.20, -0.10, 0.15, 0.0, -0.20, 0.10, 0.30, 0.0, -0.15, 0.10)
_DENSE_QUADRATIC = (0.0, 0.0, 0.10, 0.0, 0.0, -0.08, 0.0, 0.0, 0.0, 0.0, 0.10, 0.0, 0.0)
_CLICK_RATE = 0.25
_CALIBRATION_SAMPLES = 32_768

_INT64_MAX = (1 << 63) - 1
_LOW24 = (1 << 24) - 1
_MIX_SALT = -0x61C8864680B583EB  # 0x9E3779B97F4A7C15 as a signed int64


@dataclasses.dataclass
class CtrData:
    """Dense features, categorical ids and labels of ``N`` samples (and, when known, true click probabilities).

    Attributes:
        dense: float32 ``[N, 13]``, ``log1p`` of non-negative counts.
        sparse: int64 ``[N, 26]``; column ``f`` holds feature ``f``'s id hash.
        labels: float32 ``[N]`` of 0 / 1.
        probabilities: float32 ``[N]``, the hidden model's click probability, or None.
    """

    dense: torch.Tensor
    sparse: torch.Tensor
    labels: torch.Tensor
    probabilities: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n = self.labels.shape[0]
        if self.dense.shape != (n, NUM_DENSE) or self.sparse.shape != (n, NUM_SPARSE):
            raise ValueError(f"CtrData: `dense` must be [N, {NUM_DENSE}] and `sparse` [N, {NUM_SPARSE}] with "
                             f"N = len(labels) = {n}, got {tuple(self.dense.shape)} and {tuple(self.sparse.shape)}")
        if self.probabilities is not None and self.probabilities.shape != (n,):
            raise ValueError(f"CtrData: `probabilities` must be [N] = [{n}], got {tuple(self.probabilities.shape)}")

    def __len__(self) -> int:
        return self.labels.shape[0]

    def batches(self, batch_size: int, *, drop_last: bool = True) -> Iterator[tuple[torch.Tensor, torch.Tensor,
                                                                                   torch.Tensor]]:
        """``(dense, sparse, labels)`` batches in order; a short last batch only with ``drop_last=False``."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"CtrData.batches: `batch_size` must be an int >= 1, got {batch_size!r}")
        stop = len(self) - len(self) % batch_size if drop_last else len(self)
        for start in range(0, stop, batch_size):
            end = start + batch_size
            yield self.dense[start:end], self.sparse[start:end], self.labels[start:end]

    def shard(self, index: int, count: int) -> CtrData:
        """Worker ``index`` of ``count``'s contiguous part (sizes differ by at most one)."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"CtrData.shard: `count` must be an int >= 1, got {count!r}")
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
            raise ValueError(f"CtrData.shard: `index` must be an int in [0, {count}), got {index!r}")
        start, end = len(self) * index // count, len(self) * (index + 1) // count
        return self[start:end]

    def __getitem__(self, rows: slice | torch.Tensor) -> CtrData:
        """The samples ``rows`` selects (a slice or an index tensor)."""
        probabilities = None if self.probabilities is None else self.probabilities[rows]
        return CtrData(self.dense[rows], self.sparse[rows], self.labels[rows], probabilities)


def vocab_sizes(id_space_scale: float = 1.0) -> list[int]:
    """Distinct values of each of the 26 categorical features: Criteo's spread times ``id_space_scale`` (min 2)."""
    if isinstance(id_space_scale, bool) or not isinstance(id_space_scale, (int, float)) or not (
            math.isfinite(id_space_scale) and id_space_scale > 0):
        raise ValueError(f"vocab_sizes: `id_space_scale` must be a finite number > 0, got {id_space_scale!r}")
    return [max(2, round(v * id_space_scale)) for v in _CRITEO_VOCAB]


def make_ctr_data(num_samples: int, *, seed: int = 0, id_space_scale: float = 1.0, zipf: float = 1.1) -> CtrData:
    """``num_samples`` samples drawn from ``seed``; the hidden click model is the same for every seed.

    Args:
        num_samples: N >= 0.
        seed: the draw of ranks, dense counts and labels.
        id_space_scale: multiplies every feature's vocabulary size (``vocab_sizes``).
        zipf: the power-law exponent of id popularity (> 0; Criteo's ids look like ~1.1).
    """
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 0:
        raise ValueError(f"make_ctr_data: `num_samples` must be an int >= 0, got {num_samples!r}")
    if isinstance(zipf, bool) or not isinstance(zipf, (int, float)) or not (math.isfinite(zipf) and zipf > 0):
        raise ValueError(f"make_ctr_data: `zipf` must be a finite number > 0, got {zipf!r}")
    vocab = vocab_sizes(id_space_scale)
    dense, sparse, logits = _draw(num_samples, torch.Generator().manual_seed(seed), vocab, float(zipf))
    probabilities = torch.sigmoid(logits + _bias(vocab, float(zipf)))
    generator = torch.Generator().manual_seed(_label_seed(seed))  # unrelated to the features' stream
    labels = (torch.rand(num_samples, generator=generator) < probabilities).float()
    return CtrData(dense, sparse, labels, probabilities)


def hashed_to_rows(sparse: torch.Tensor, rows: int) -> torch.Tensor:
    """Ids mapped into ``[0, rows)`` for fixed-size tables: ``splitmix64(id ^ salt)`` modulo ``rows``, non-negative.

    Every fixed-table peer (``nn.EmbeddingBag``, TensorFlow, TorchRec) uses this one mapping,
    so their collisions are the same.
    """
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"hashed_to_rows: `rows` must be an int >= 1, got {rows!r}")
    if not isinstance(sparse, torch.Tensor) or sparse.dtype != torch.int64:
        raise TypeError(f"hashed_to_rows: `sparse` must be an int64 tensor, got {sparse!r:.60}")
    return torch.remainder(splitmix64(sparse ^ _MIX_SALT), rows)


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """ROC AUC by ranks (Mann-Whitney U), tied scores sharing their average rank.

    Args:
        scores: ``[N]`` real scores (logits or probabilities; only their order counts).
        labels: ``[N]`` of 0 / 1, both present.
    """
    scores, labels = scores.detach().reshape(-1).double(), labels.detach().reshape(-1)
    if scores.shape != labels.shape:
        raise ValueError(f"auc: `scores` and `labels` must have the same number of elements, "
                         f"got {scores.numel()} and {labels.numel()}")
    positive = labels > 0.5
    n_pos = int(positive.sum())
    n_neg = labels.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        raise ValueError(f"auc: needs both classes, got {n_pos} positive and {n_neg} negative labels")
    _, inverse, counts = torch.unique(scores, sorted=True, return_inverse=True, return_counts=True)
    last_rank = torch.cumsum(counts, 0).double()  # 1-based rank of each distinct score's last copy
    average_rank = last_rank - (counts.double() - 1) / 2
    rank_sum = average_rank[inverse][positive].sum().item()
    return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def bayes_auc(data: CtrData) -> float:
    """The AUC of the true click probabilities on ``data``: the best any model can reach there."""
    if data.probabilities is None:
        raise ValueError("bayes_auc: `data.probabilities` is None; fix: pass data made by make_ctr_data")
    return auc(data.probabilities, data.labels)


def _label_seed(seed: int) -> int:
    """The labels' seed, derived from ``seed`` (a non-negative int below 2**63)."""
    return int(splitmix64(torch.tensor([seed ^ 0x1ABE1], dtype=torch.int64)).item()) & _INT64_MAX


def _draw(n: int, generator: torch.Generator, vocab: list[int], zipf: float) -> tuple[torch.Tensor, torch.Tensor,
                                                                                      torch.Tensor]:
    """Dense features, ids and the hidden logit (without the bias) of ``n`` samples."""
    counts = torch.exp(torch.tensor(_DENSE_MU) + torch.tensor(_DENSE_SIGMA) * torch.randn(n, NUM_DENSE,
                                                                                       generator=generator))
    dense = torch.log1p(torch.floor(counts - 1).clamp_(min=0))
    standard = (dense - torch.tensor(_DENSE_MU).clamp(min=0)) / torch.tensor(_DENSE_SIGMA)
    logits = standard @ torch.tensor(_DENSE_LINEAR) + (standard ** 2 - 1) @ torch.tensor(_DENSE_QUADRATIC)
    ranks, ids = [], []
    for f, size in enumerate(vocab):
        rank = _power_law_ranks(torch.rand(n, generator=generator, dtype=torch.float64), size, zipf)
        id_of, weight_of = _tabulated(n, rank, size, lambda r: _id_and_weight(f, r))  # noqa: B023 - called within the iteration
        ranks.append(rank)
        ids.append(id_of)
        logits += weight_of
    for p, (a, b) in enumerate(_PAIRS):
        size_b = vocab[b]
        pair = ranks[a] * size_b + ranks[b]
        (weight_of,) = _tabulated(n, pair, vocab[a] * size_b, lambda c: _pair_weight(p, c // size_b, c % size_b))  # noqa: B023 - called within the iteration
        logits += weight_of
    sparse = torch.stack(ids, dim=1)
    return dense.float(), sparse, logits


def _tabulated(n: int, keys: torch.Tensor, size: int,
               fn: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    """``fn(keys)`` for ``n`` keys in ``[0, size)``, through a table of all ``size`` values when that is cheaper."""
    if size > n:
        return fn(keys)
    return tuple(column[keys] for column in fn(torch.arange(size, dtype=torch.int64)))


def _id_and_weight(feature: int, rank: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Feature ``feature``'s ids of ``rank`` and their hidden weights (larger for frequent ranks)."""
    ids = splitmix64((feature << 40) | rank)
    scale = _FEATURE_SCALE[feature] * (1.0 + rank.float()) ** -_RANK_DECAY
    return ids, scale * _hashed_normal(ids)


def _pair_weight(pair: int, rank_a: torch.Tensor, rank_b: torch.Tensor) -> tuple[torch.Tensor]:
    """The hidden effect of pair ``pair``'s two ranks together."""
    key = splitmix64(((pair + 1) << 50) | (rank_a << 25) | rank_b)
    return (_PAIR_SCALE * _hashed_normal(key),)


def _power_law_ranks(u: torch.Tensor, size: int, zipf: float) -> torch.Tensor:
    """Ranks in ``[0, size)`` with ``P(r)`` about ``(1 + r) ** -zipf``, from uniforms ``u`` (inverse CDF of
    the continuous law on ``[1, size + 1)``)."""
    top = float(size + 1)
    if abs(zipf - 1.0) < 1e-9:
        x = top ** u
    else:
        e = 1.0 - zipf
        x = (1.0 + u * (top ** e - 1.0)) ** (1.0 / e)
    return (x.floor().long() - 1).clamp_(0, size - 1)


def _hashed_normal(keys: torch.Tensor) -> torch.Tensor:
    """A standard normal (float32) per int64 key, counted from its hash: Box-Muller of two 24-bit uniforms."""
    h = splitmix64(keys ^ _MODEL_SALT)
    u1 = ((h >> 40) & _LOW24).float().add_(0.5).mul_(2.0 ** -24)  # in (0, 1): the log is finite
    u2 = ((h >> 8) & _LOW24).float().mul_(2.0 ** -24)
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)


def _bias(vocab: list[int], zipf: float) -> float:
    """The logit offset that makes the click rate ``_CLICK_RATE``, found on a fixed calibration draw.

    Fixed per (vocabulary, zipf), never per data seed or size, so every draw shares one model.
    """
    key = (tuple(vocab), zipf)
    if key not in _BIAS_CACHE:
        _, _, logits = _draw(_CALIBRATION_SAMPLES, torch.Generator().manual_seed(_MODEL_SALT), vocab, zipf)
        low, high = -20.0, 20.0
        for _ in range(60):
            middle = (low + high) / 2
            low, high = (middle, high) if torch.sigmoid(logits + middle).mean() < _CLICK_RATE else (low, middle)
        _BIAS_CACHE[key] = (low + high) / 2
    return _BIAS_CACHE[key]


_BIAS_CACHE: dict[tuple[tuple[int, ...], float], float] = {}
