"""Training patterns of real models that already equal DDP, kept so that they stay so.

- Activation checkpointing (``torch.utils.checkpoint``, ``use_reentrant=False``): the
  block's forward runs again inside backward, reading its parameters again.
- A sparse embedding stepped by ``SparseAdam`` beside ``Adam`` for the dense layers:
  two optimizers, one with sparse gradients (all-gathered, not all-reduced).

Each is trained under DDP (2 ranks of the warm pool, same shards) and under
MultiWorkerMirroredStrategy (worker r against rank r) and MirroredStrategy (replica i
against rank i) in the same pool call.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import unison

ADDRESSES = ["127.0.0.1:1", "127.0.0.1:2"]  # never bound: the pool's gloo group is reused
STEPS = 4
VOCAB = 50


class _CheckpointedMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh())
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(checkpoint(self.inner, x, use_reentrant=False))


class _SparseBag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8, sparse=True)
        self.head = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids).mean(dim=1))


def _checkpointed() -> tuple[nn.Module, Callable[[nn.Module], list[torch.optim.Optimizer]]]:
    return _CheckpointedMLP(), lambda m: [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)]


def _sparse() -> tuple[nn.Module, Callable[[nn.Module], list[torch.optim.Optimizer]]]:
    return _SparseBag(), lambda m: [torch.optim.SparseAdam(list(m.embed.parameters()), lr=0.05),
                                    torch.optim.Adam(list(m.head.parameters()), lr=0.01)]


CASES = {"checkpointing": _checkpointed, "sparse_adam": _sparse}


def _batches(case: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    if case == "sparse_adam":
        return [(torch.randint(0, VOCAB, (8, 5), generator=g), torch.randint(0, 4, (8,), generator=g))
                for _ in range(STEPS)]
    return [(torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(STEPS)]


def _train(model: nn.Module, forward: Callable, optimizers: list, data: list, run: Any = None) -> None:
    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        for opt in optimizers:
            opt.zero_grad()
        nn.functional.cross_entropy(forward(x), y).backward()
        for opt in optimizers:
            opt.step()

    for x, y in data:
        step(x, y) if run is None else run(step, args=(x, y))


def _values(model: nn.Module, replica: int = 0) -> list[torch.Tensor]:
    values = []
    for p in model.parameters():
        tensor = p.values[replica] if isinstance(p, unison.DistributedValues) else p
        values.append(tensor.detach().as_subclass(torch.Tensor).clone())
    return values


def _ddp_and_unison(rank: int, world: int, case: str) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    shards = [(x.chunk(world)[rank], y.chunk(world)[rank]) for x, y in _batches(case)]
    torch.manual_seed(0)
    model, make_optimizers = CASES[case]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        ddp = DistributedDataParallel(model, broadcast_buffers=False)
    _train(model, ddp, make_optimizers(model), shards)
    del ddp
    report: dict[str, Any] = {"ddp": _values(model)}
    resolver = unison.SimpleClusterResolver(unison.ClusterSpec({"worker": ADDRESSES[:world]}),
                                            task_type="worker", task_id=rank)
    strategy = unison.MultiWorkerMirroredStrategy(resolver)
    with strategy.scope():
        torch.manual_seed(0)
        model, make_optimizers = CASES[case]()
        optimizers = make_optimizers(model)
    _train(model, model, optimizers, shards, strategy.run)
    report["mwms"] = _values(model)
    if rank == 0:  # both replicas of one process, on the two ranks' shards
        mirrored = unison.MirroredStrategy([f"cpu:{i}" for i in range(world)])
        with mirrored.scope():
            torch.manual_seed(0)
            model, make_optimizers = CASES[case]()
            optimizers = make_optimizers(model)
        batches = [(unison.PerReplica(list(x.chunk(world))), unison.PerReplica(list(y.chunk(world))))
                   for x, y in _batches(case)]
        _train(model, model, optimizers, batches, mirrored.run)
        report["mirrored"] = [_values(model, i) for i in range(world)]
    return report


def _largest(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert len(a) == len(b)
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("case", sorted(CASES))
def test_pattern_equals_ddp(worker_pool, case):
    ranks = worker_pool.run(_ddp_and_unison, case, timeout=60)
    torch.manual_seed(0)
    untrained = _values(CASES[case]()[0])
    assert _largest(ranks[0]["ddp"], untrained) > 1e-3  # training moved the weights
    for rank, report in enumerate(ranks):
        assert _largest(report["mwms"], report["ddp"]) <= 1e-5, (case, "mwms", rank)
        assert _largest(ranks[0]["mirrored"][rank], report["ddp"]) <= 1e-5, (case, "mirrored", rank)
