"""A small recommendation model for the online serving tests: two tables (one pooled, with eviction) and a
dense head, and a training loop whose ids drift (new ones come, old ones age out)."""

from __future__ import annotations

import torch
from torch import nn

import unison
from unison.embeddings import EvictUnseen


class Ranker(nn.Module):
    """Two tables and a dense head: what a recommendation model looks like to the exporter."""

    def __init__(self) -> None:
        super().__init__()
        self.users = unison.DynamicEmbedding(4, mode="sum", seed=1, eviction=EvictUnseen(3))
        self.items = unison.DynamicEmbedding(4, seed=2)
        self.head = nn.Linear(8, 1)

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.users(users), self.items(items)], dim=1)).squeeze(1)


def make() -> tuple[Ranker, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Ranker()
    return model, torch.optim.Adagrad(model.parameters(), lr=0.1)


def train(model: Ranker, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for i in range(steps):
        users = torch.randint(0, 200, (16, 2), generator=g) + 37 * (seed * steps + i)
        items = torch.randint(0, 50, (16,), generator=g)
        opt.zero_grad()
        model(users, items).pow(2).mean().backward()
        opt.step()
