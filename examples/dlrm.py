"""A DLRM-style click-through model (Naumov et al., 2019) over the synthetic Criteo-schema data.

Run: ``python examples/dlrm.py`` (one device: trains on 200k samples, prints held-out AUC).

The model: a bottom MLP maps the 13 dense features to one ``embedding_dim`` vector; each
of the 26 categorical features is looked up in its own embedding module (a bag of ids
pooled by sum); the 27 vectors interact by their pairwise dot products (the upper
triangle without the diagonal, 351 values), which with the bottom output feed a top MLP
that gives one click logit. The embedding modules are passed in, so the same model runs
on ``unison.DynamicEmbedding`` (any int64 id, rows made on first touch:
:func:`dynamic_embeddings`) and on fixed ``nn.EmbeddingBag`` tables whose peers map ids
with ``ctr_data.hashed_to_rows`` first (:func:`fixed_embeddings`).
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from ctr_data import NUM_DENSE, NUM_SPARSE, CtrData, auc, bayes_auc, make_ctr_data
from torch import nn

import unison
from unison.embeddings import Uniform

__all__ = ["DLRM", "pairwise_dots", "dynamic_embeddings", "dynamic_table", "fixed_embeddings", "train_one_device",
           "evaluate"]


def _mlp(sizes: Sequence[int], *, last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(fan_in, fan_out))
        if last_relu or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class _PairwiseDots(torch.autograd.Function):
    """The dot product of every pair of a sample's vectors, ``[B, n, dim] -> [B, n(n-1)/2]``: the upper
    triangle of ``V Vᵀ`` without its diagonal, row by row (``torch.triu_indices``'s order).

    Why not plain autograd: its backward of ``bmm(V, Vᵀ)[:, i, j]`` puts the pairs' gradient into a
    ``[B, n, n]`` of zeros, runs two batched products on transposed operands and adds them strided,
    1.1 ms of a 2.4 ms DLRM step at batch 256 on one CPU thread (``torch.profiler``). ``V Vᵀ`` is
    symmetric, so the gradient is ``(G + Gᵀ) V``: the pairs' gradient written at (i, j) and (j, i),
    then one product, 0.3 ms; and the forward takes the triangle by ``index_select`` (the product and
    the selection 0.1 ms, against 0.3 with the advanced index). The same pairs; the gradient's sums
    run in another order. The DLRM's dense step (embeddings given) went from 2.4 to 2.0 ms.
    """

    @staticmethod
    def forward(ctx: Any, vectors: torch.Tensor, upper: torch.Tensor, mirrored: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(vectors, upper, mirrored)
        batch, n = vectors.shape[0], vectors.shape[1]
        return torch.bmm(vectors, vectors.transpose(1, 2)).reshape(batch, n * n).index_select(1, upper)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        vectors, upper, mirrored = ctx.saved_tensors
        batch, n = vectors.shape[0], vectors.shape[1]
        symmetric = grad.new_zeros(batch, n * n)
        symmetric.scatter_(1, upper.expand(batch, -1), grad).scatter_(1, mirrored.expand(batch, -1), grad)
        return torch.bmm(symmetric.view(batch, n, n), vectors), None, None


def _pair_indices(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs ``i < j`` of ``n`` vectors as entries of a flattened ``[n, n]``, and their mirrored
    entries ``(j, i)`` in the same order: :class:`_PairwiseDots`'s index arguments."""
    upper = torch.triu_indices(n, n, offset=1)
    return upper[0] * n + upper[1], upper[1] * n + upper[0]


def pairwise_dots(vectors: torch.Tensor) -> torch.Tensor:
    """``[B, n, dim] -> [B, n(n-1)/2]``: each sample's dot products of its vectors ``i < j``, in
    ``torch.triu_indices(n, n, 1)``'s order (the DLRM's interaction; see :class:`_PairwiseDots`)."""
    flat, mirrored = (index.to(vectors.device) for index in _pair_indices(vectors.shape[1]))
    return _PairwiseDots.apply(vectors, flat, mirrored)


class DLRM(nn.Module):
    """Bottom MLP, one embedding module per sparse feature, dot interaction, top MLP: one logit per sample.

    Args:
        embeddings: 26 modules, each called as ``module(ids)`` with int64 ``ids`` of shape
            ``[B, k]`` (a bag of ``k`` ids per sample) and returning ``[B, embedding_dim]``;
            or one module for every feature (a table collection, as TorchRec fuses them),
            called with ``[B, 26]`` and returning ``[B, 26, embedding_dim]``: one lookup per
            step instead of 26 (the features' ids are distinct hashes, so they share it).
        embedding_dim: the width of every embedding and of the bottom MLP's output.
        bottom: hidden sizes of the bottom MLP, its last equal to ``embedding_dim``.
        top: sizes of the top MLP after its input, its last 1.
        num_dense: dense features (the bottom MLP's input); Criteo's 13 by default.
        feature_widths: the columns of ``sparse`` each feature takes, in order; a width above 1
            is a bag of ids pooled by sum (e.g. a movie's genres). Default: 26 features of one id.
        padding_id: an id that stands for nothing in a bag's unused columns: it adds no vector
            to its bag and takes no gradient (``nn.EmbeddingBag``'s ``padding_idx``); None: every
            column is an id. A fused table still looks the padding up (one row, never trained).
    """

    def __init__(self, embeddings: nn.Module | Sequence[nn.Module], *, embedding_dim: int = 16,
                 bottom: Sequence[int] = (64, 16), top: Sequence[int] = (64, 32, 1), num_dense: int = NUM_DENSE,
                 feature_widths: Sequence[int] | None = None, padding_id: int | None = None):
        super().__init__()
        widths = tuple(feature_widths) if feature_widths is not None else (1,) * NUM_SPARSE
        if not widths or any(isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in widths):
            raise ValueError(f"DLRM: `feature_widths` must be ints >= 1, one per sparse feature, "
                             f"got {feature_widths!r}")
        self.feature_widths = widths
        self.padding_id = padding_id
        self.fused = isinstance(embeddings, nn.Module) and not isinstance(embeddings, nn.ModuleList)
        if not self.fused and len(embeddings) != len(widths):  # type: ignore[arg-type]
            raise ValueError(f"DLRM: `embeddings` must hold one module per sparse feature ({len(widths)}), "
                             f"got {len(embeddings)}")
        if not bottom or bottom[-1] != embedding_dim:
            raise ValueError(f"DLRM: `bottom` must end with embedding_dim={embedding_dim} (its output meets the "
                             f"embeddings in the dot interaction), got {tuple(bottom)}")
        if not top or top[-1] != 1:
            raise ValueError(f"DLRM: `top` must end with 1 (one logit), got {tuple(top)}")
        self.embedding_dim = embedding_dim
        self.embeddings = (embeddings if self.fused or isinstance(embeddings, nn.ModuleList)
                           else nn.ModuleList(embeddings))
        self.bottom = _mlp((num_dense, *bottom), last_relu=True)
        vectors = len(widths) + 1
        self.top = _mlp((embedding_dim + vectors * (vectors - 1) // 2, *top), last_relu=False)
        pairs, mirrored = _pair_indices(vectors)
        self.register_buffer("_pairs", pairs, persistent=False)
        self.register_buffer("_mirrored_pairs", mirrored, persistent=False)
        starts = [0]
        for width in widths:
            starts.append(starts[-1] + width)
        self._starts = starts
        feature_of_column = torch.repeat_interleave(torch.arange(len(widths)), torch.tensor(widths))
        self.register_buffer("_feature_of_column", feature_of_column, persistent=False)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        """Logits ``[B]`` of ``dense`` float ``[B, num_dense]`` and ``sparse`` int64 ``[B, sum(feature_widths)]``
        (feature f in its columns; by default ``[B, 26]``, feature f in column f)."""
        columns = self._starts[-1]
        if sparse.dim() != 2 or sparse.shape[1] != columns:
            raise ValueError(f"DLRM: `sparse` must be [B, {columns}] (the sum of feature_widths), "
                             f"got {tuple(sparse.shape)}")
        x = self.bottom(dense)
        present = None if self.padding_id is None else (sparse != self.padding_id).to(x.dtype)  # [B, columns]
        if self.fused:
            looked_up = self.embeddings(sparse)  # [B, columns, dim]
            if present is not None:
                looked_up = looked_up * present.unsqueeze(2)
            if columns != len(self.feature_widths):  # bags: sum each feature's columns
                looked_up = looked_up.new_zeros(sparse.shape[0], len(self.feature_widths), looked_up.shape[2]
                                                ).index_add_(1, self._feature_of_column, looked_up)
            vectors = torch.cat([x.unsqueeze(1), looked_up], dim=1)  # [B, features + 1, dim]
        else:
            pooled = [module(sparse[:, a:b]) if present is None
                      else module(sparse[:, a:b], per_sample_weights=present[:, a:b])
                      for module, a, b in zip(self.embeddings, self._starts[:-1], self._starts[1:])]
            vectors = torch.stack([x, *pooled], dim=1)  # [B, features + 1, dim]
        pairs = _PairwiseDots.apply(vectors, self._pairs, self._mirrored_pairs)  # 351 for Criteo's 26 + 1
        return self.top(torch.cat([x, pairs], dim=1)).squeeze(1)


def dynamic_embeddings(dim: int = 16, seed: int = 0) -> nn.ModuleList:
    """26 ``unison.DynamicEmbedding(dim, mode="sum")``, rows uniform in ``±1/sqrt(dim)``; feature f's seed is
    ``seed + f``."""
    bound = 1.0 / math.sqrt(dim)
    return nn.ModuleList(unison.DynamicEmbedding(dim, mode="sum", seed=seed + f, initializer=Uniform(-bound, bound))
                         for f in range(NUM_SPARSE))


def dynamic_table(dim: int = 16, seed: int = 0, *, row_wise_adagrad: bool = False,
                  **policies: Any) -> unison.DynamicEmbedding:
    """One ``unison.DynamicEmbedding(dim)`` for all 26 features (their ids are distinct hashes), rows
    uniform in ``±1/sqrt(dim)``: the fast layout, one lookup and one push per step
    (``row_wise_adagrad``: trained by Adagrad, one accumulator per row).

    ``policies``: the table policies of ``DynamicEmbedding`` (``admission``, ``capacity``,
    ``capacity_policy``, ``eviction``)."""
    bound = 1.0 / math.sqrt(dim)
    return unison.DynamicEmbedding(dim, seed=seed, initializer=Uniform(-bound, bound),
                                   row_wise_adagrad=row_wise_adagrad, **policies)


def fixed_embeddings(rows: int, dim: int = 16, *, sparse: bool = False) -> nn.ModuleList:
    """26 ``nn.EmbeddingBag(rows, dim, mode="sum")``, rows uniform in ``±1/sqrt(dim)`` (ids mapped by
    ``ctr_data.hashed_to_rows`` first).

    ``sparse=True`` gives sparse gradients (only the looked-up rows; Adagrad and SGD take
    them), much faster on one device than a dense ``[rows, dim]`` gradient per table per step.
    """
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"fixed_embeddings: `rows` must be an int >= 1, got {rows!r}")
    bound = 1.0 / math.sqrt(dim)
    tables = nn.ModuleList(nn.EmbeddingBag(rows, dim, mode="sum", sparse=sparse) for _ in range(NUM_SPARSE))
    for table in tables:
        nn.init.uniform_(table.weight, -bound, bound)
    return tables


def train_one_device(model: nn.Module, data: CtrData, *, batch_size: int = 256, lr: float = 0.05,
                     steps: int | None = None) -> dict:
    """One pass (or ``steps`` batches) of Adagrad over all parameters on BCE-with-logits; returns timings and losses.

    Returns:
        ``{"samples", "seconds", "loss_first", "loss_last"}``: samples trained on, wall time,
        and the mean loss of the first and last 50 steps.
    """
    optimizer = torch.optim.Adagrad(model.parameters(), lr=lr)
    model.train()
    losses: list[float] = []
    samples = 0
    start = time.perf_counter()
    for step, (dense, sparse, labels) in enumerate(data.batches(batch_size)):
        if steps is not None and step >= steps:
            break
        optimizer.zero_grad(set_to_none=True)
        loss = F.binary_cross_entropy_with_logits(model(dense, sparse), labels)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        samples += labels.shape[0]
    seconds = time.perf_counter() - start
    window = max(1, min(50, len(losses) // 2))
    mean = (lambda xs: sum(xs) / len(xs)) if losses else (lambda xs: float("nan"))
    return {"samples": samples, "seconds": seconds, "loss_first": mean(losses[:window]),
            "loss_last": mean(losses[-window:])}


def evaluate(model: nn.Module, data: CtrData, batch_size: int = 4096) -> float:
    """AUC of ``model``'s logits on ``data`` (in eval mode, no gradients; the model is left in eval mode)."""
    model.eval()
    with torch.no_grad():
        scores = [model(dense, sparse) for dense, sparse, _ in data.batches(batch_size, drop_last=False)]
    return auc(torch.cat(scores), data.labels)


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=int, default=200_000, help="training samples (one epoch)")
    parser.add_argument("--test", type=int, default=50_000, help="held-out samples")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    train = make_ctr_data(args.train, seed=args.seed)
    test = make_ctr_data(args.test, seed=args.seed + 1)
    model = DLRM(dynamic_table(args.dim, seed=args.seed), embedding_dim=args.dim, bottom=(64, args.dim))
    before = evaluate(model, test)
    stats = train_one_device(model, train, batch_size=args.batch_size, lr=args.lr)
    result = {**stats, "auc_before": before, "auc": evaluate(model, test), "bayes_auc": bayes_auc(test),
              "samples_per_s": stats["samples"] / stats["seconds"]}
    print(f"trained on {result['samples']} samples in {result['seconds']:.1f} s "
          f"({result['samples_per_s']:.0f} samples/s); loss {result['loss_first']:.4f} -> {result['loss_last']:.4f}")
    print(f"held-out AUC {result['auc']:.4f} (untrained {before:.4f}, Bayes-optimal {result['bayes_auc']:.4f})")
    return result


if __name__ == "__main__":
    main()
