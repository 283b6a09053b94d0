"""unison's buffers differ from DDP's default on purpose: they are never re-broadcast.

DDP (``broadcast_buffers=True``, its default) copies rank 0's buffers to every rank before
each forward; TensorFlow's strategies, and unison's, leave each worker's running
statistics its own after the chief's initial values. Parameters are the same either way
(BatchNorm normalises a training batch by its own statistics). This test pins the
difference down, so that neither side changes unnoticed: worker 0's statistics equal DDP
rank 0's, worker 1's differ from DDP rank 1's, and equal DDP with
``broadcast_buffers=False``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import unison

ADDRESSES = ["127.0.0.1:1", "127.0.0.1:2"]  # never bound: the pool's gloo group is reused
STEPS = 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def _shard(rank: int, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 6, generator=g) * (1 + step), torch.randn(16, 3, generator=g)) for step in range(STEPS)]
    return [(x.chunk(world)[rank] + rank, y.chunk(world)[rank]) for x, y in batches]  # workers see other statistics


def _train(model: nn.Module, forward: nn.Module, data, run=None) -> dict[str, torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        nn.functional.mse_loss(forward(x), y).backward()
        opt.step()

    for x, y in data:
        step(x, y) if run is None else run(step, args=(x, y))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _three_ways(rank: int, world: int) -> dict[str, dict[str, torch.Tensor]]:
    from torch.nn.parallel import DistributedDataParallel

    states = {}
    for broadcast in (True, False):
        model = _model()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            ddp = DistributedDataParallel(model, broadcast_buffers=broadcast)
        states[f"ddp_broadcast_{broadcast}"] = _train(model, ddp, _shard(rank, world))
        del ddp
    resolver = unison.SimpleClusterResolver(unison.ClusterSpec({"worker": ADDRESSES[:world]}),
                                            task_type="worker", task_id=rank)
    strategy = unison.MultiWorkerMirroredStrategy(resolver)
    with strategy.scope():
        model = _model()
    states["unison"] = _train(model, model, _shard(rank, world), strategy.run)
    return states


def _largest(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], buffers: bool) -> float:
    names = [n for n in a if ("running" in n or "num_batches" in n) == buffers]
    return max(float((a[n].double() - b[n].double()).abs().max()) for n in names)


@pytest.mark.timeout(90)
def test_buffers_are_not_rebroadcast_unlike_ddps_default(worker_pool):
    ranks = worker_pool.run(_three_ways, timeout=60)
    for states in ranks:  # parameters: the same all three ways
        assert _largest(states["unison"], states["ddp_broadcast_True"], buffers=False) <= 1e-5
        assert _largest(states["unison"], states["ddp_broadcast_False"], buffers=True) <= 1e-5
    assert _largest(ranks[0]["unison"], ranks[0]["ddp_broadcast_True"], buffers=True) <= 1e-5
    # worker 1 keeps its own running statistics; DDP's rank 1 restarts from rank 0's before each forward
    assert _largest(ranks[1]["unison"], ranks[1]["ddp_broadcast_True"], buffers=True) > 1e-2
