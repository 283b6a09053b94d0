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
            "compressed_buckets": len(getattr(sync.bucket_transport, "_wires", {})),
            "shared_buckets": sum(sync.buckets_in_shared_memory)}


def powersgd_with_grad_scaler(rank: int, world: int, overflow_step: int | None, drop_step: int | None = None):
    """PowerSGD with ``torch.amp.GradScaler``; the batch of ``overflow_step`` (if any) holds
    an inf in worker 1's half, the batch of ``drop_step`` (if any) is left out and the
    scale halved in its place, as an overflow would. Returns the weights and the steps
    the scaler skipped."""
    strategy = strategy_with(rank, world, unison.PowerSGD(rank=2, start_iter=2))
    with strategy.scope():
        model = make_mlp(2, 16)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1000)
    batches = global_batches(steps=14, batch=16)
    if overflow_step is not None:
        batches[overflow_step][0][-1, 0] = float("inf")
    if drop_step is not None:
        del batches[drop_step]
    skipped = []
    for step, (x, y) in enumerate(batches):
        opt.zero_grad()
        scaler.scale(nn.functional.cross_entropy(model(x.chunk(world)[rank]), y.chunk(world)[rank])).backward()
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        if scaler.get_scale() < scale:
            skipped.append(step)
        if step + 1 == drop_step:  # the scale the skipped step would leave: PowerSGD compresses scaled gradients
            scaler.update(new_scale=scale / 2)
    return {"weights": [p.detach().clone() for p in model.parameters()], "skipped": skipped}
