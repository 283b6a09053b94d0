"""Worker functions for the gradient compression tests (module level, so spawned processes import them)."""

from __future__ import annotations

import torch
from torch import nn

import unison

from tests.multi_worker._workers import global_batches, make_mlp


def strategy_with(rank: int, world: int, compression: str, implementation: str = "AUTO"):
    spec = unison.ClusterSpec({"worker": [f"127.0.0.1:{i + 1}" for i in range(world)]})
    options = unison.CommunicationOptions(compression=compression, implementation=implementation, timeout_seconds=30)
    return unison.MultiWorkerMirroredStrategy(unison.SimpleClusterResolver(spec, task_type="worker", task_id=rank),
                                              options, devices=["cpu:0"])


def batch_reduces(rank: int, world: int, compression: str, scale: float):
    """Means of float32, float64 and int64 tensors (float ones times ``scale``); the transport."""
    strategy = strategy_with(rank, world, compression)
    g = torch.Generator().manual_seed(rank)
    tensors = [torch.randn(1000, generator=g) * scale, torch.randn(7, 3, generator=g, dtype=torch.float64) * scale,
               torch.arange(4) * (rank + 1)]
    pairs = [(unison.PerReplica([t]), "cpu:0") for t in tensors]
    means = [t.clone() for t in strategy.extended.batch_reduce_to("mean", pairs)]
    return {"means": means, "inputs": tensors, "transport": type(strategy.extended.cross_device_ops.transport).__name__}


def train(rank: int, world: int, compression: str, scale: float = 1.0):
    """The MLP of the multi-worker tests, 20 steps; the loss is multiplied by ``scale``
    (1e6 makes float16 gradient sums overflow)."""
    strategy = strategy_with(rank, world, compression)
    with strategy.scope():
        model = make_mlp(2, 16)
        opt = torch.optim.SGD(model.parameters(), lr=0.1 / scale)
    for x, y in global_batches():
        opt.zero_grad()
        (nn.functional.cross_entropy(model(x.chunk(world)[rank]), y.chunk(world)[rank]) * scale).backward()
        opt.step()
    sync = strategy.extended.components.gradient_sync
    return {"weights": [p.detach().clone() for p in model.parameters()],
            "compressed_buckets": sum(b.wire is not None for b in sync._buckets),
            "shared_buckets": sum(sync.buckets_in_shared_memory)}
