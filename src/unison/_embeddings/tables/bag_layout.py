"""Bags of ids as a layout: which bag each id pools into, and with what weight.

``nn.EmbeddingBag`` pools a bag of rows into one (sum, mean, or a weighted sum). Written
as ``out[b] = sum(w[i] * row[ids[i]] for i with bags[i] == b)`` every mode is one
weighted sum (mean: ``w = 1 / len(bag)``), which a ps task can compute over the rows it
holds: it returns one partial row per bag instead of every distinct row, and a pushed
gradient of a bag expands there to its ids (``grad[bags[i]] * w[i]``).
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["BagLayout", "bag_layout"]


@dataclasses.dataclass(frozen=True)
class BagLayout:
    """Flat ids with the bag each belongs to and its weight; ``num_bags`` bags in all."""

    ids: torch.Tensor
    bags: torch.Tensor
    weights: torch.Tensor
    num_bags: int

    def pool(self, rows: torch.Tensor) -> torch.Tensor:
        """``[num_bags, dim]``: each bag's weighted sum of ``rows`` (one row per id, repeats counted)."""
        pooled = torch.zeros(self.num_bags, rows.shape[1], dtype=rows.dtype)
        return pooled.index_add_(0, self.bags, rows * self.weights.to(rows.dtype).unsqueeze(1))

    def expand(self, bag_grads: torch.Tensor) -> torch.Tensor:
        """Each id's gradient from its bag's: ``bag_grads[bags] * weights`` (the adjoint of :meth:`pool`)."""
        return bag_grads.index_select(0, self.bags) * self.weights.to(bag_grads.dtype).unsqueeze(1)


def bag_layout(ids: torch.Tensor, offsets: torch.Tensor | None, per_sample_weights: torch.Tensor | None,
               mode: str, dtype: torch.dtype) -> BagLayout:
    """The layout of ``nn.EmbeddingBag``'s input: a 2-D ``ids`` of equal bags, or 1-D ``ids`` with ``offsets``."""
    if offsets is None:
        num_bags, length = ids.shape
        lengths = torch.full((num_bags,), length, dtype=torch.int64)
    else:
        num_bags = offsets.numel()
        lengths = torch.diff(offsets.to(torch.int64), append=torch.tensor([ids.numel()]))
    bags = torch.repeat_interleave(torch.arange(num_bags), lengths)
    if per_sample_weights is not None:
        weights = per_sample_weights.detach().reshape(-1).to(dtype)
    elif mode == "mean":
        weights = (1.0 / lengths.clamp(min=1).to(dtype)).index_select(0, bags)
    else:
        weights = torch.ones(bags.numel(), dtype=dtype)
    return BagLayout(ids.reshape(-1), bags, weights, num_bags)
