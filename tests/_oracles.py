"""Plain-PyTorch oracles shared by test folders."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn


def train_averaged_copies(models: list[nn.Module], batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Data parallelism by hand: copy ``k`` of ``len(models)`` trains on part ``k`` of each batch
    (cross entropy, SGD with momentum 0.9, lr 0.1), the copies' gradients averaged before each
    identical step. Each copy keeps its own buffers (BatchNorm statistics), as replicas and
    workers do."""
    parts = len(models)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    for x, y in batches:
        for model, opt, part_x, part_y in zip(models, opts, x.chunk(parts), y.chunk(parts), strict=True):
            opt.zero_grad()
            F.cross_entropy(model(part_x), part_y).backward()
        for params in zip(*(m.parameters() for m in models), strict=True):
            mean = sum(p.grad for p in params) / parts
            for p in params:
                p.grad = mean.clone()
        for opt in opts:
            opt.step()
