"""Worker functions for the CUDA tests (module level, so the workers import them by name)."""

from __future__ import annotations

import torch

import unison

from tests.multi_worker._workers import global_batches, mlp_and_step


def _strategy(rank: int, world: int, devices, **options):
    spec = unison.ClusterSpec({"worker": [f"127.0.0.1:{i + 1}" for i in range(world)]})
    resolver = unison.SimpleClusterResolver(spec, task_type="worker", task_id=rank)
    return unison.MultiWorkerMirroredStrategy(resolver, unison.CommunicationOptions(timeout_seconds=60, **options),
                                              devices=devices)


def train_on_cuda(rank: int, world: int, implementation: str = "AUTO", compression: str = "none"):
    """The multi-worker MLP trained on ``cuda:0`` (every worker on the one GPU); the
    weights come back on the CPU with the group's backend and transport."""
    chosen = unison.PowerSGD(rank=1, start_iter=2, min_compression_rate=1) if compression == "powersgd" else compression
    strategy = _strategy(rank, world, ["cuda:0"], implementation=implementation, compression=chosen)
    model, step = mlp_and_step(strategy, 2, 16)
    for x, y in global_batches():
        strategy.run(step, args=(x.chunk(world)[rank].cuda(), y.chunk(world)[rank].cuda()))
    extended = strategy.extended
    return {"weights": [p.detach().cpu().clone() for p in model.parameters()],
            "devices": sorted({str(p.device) for p in model.parameters()}),
            "backend": extended.cross_device_ops.worker_group.backend,
            "transport": type(extended.cross_device_ops.transport).__name__}


def reduce_on_cuda(rank: int, world: int, implementation: str = "AUTO"):
    """Sum and mean of CUDA tensors across the workers through ``strategy.reduce`` and
    ``batch_reduce_to``; the results come back on the CPU with their devices."""
    strategy = _strategy(rank, world, ["cuda:0"], implementation=implementation)
    g = torch.Generator().manual_seed(rank)
    tensors = [torch.randn(1000, generator=g), torch.randn(7, 3, generator=g, dtype=torch.float64),
               torch.arange(4) * (rank + 1)]
    pairs = [(unison.PerReplica([t.cuda()]), "cuda:0") for t in tensors]
    means = strategy.extended.batch_reduce_to("mean", pairs)
    total = strategy.reduce("sum", unison.PerReplica([torch.full((3,), float(rank + 1), device="cuda:0")]), axis=None)
    return {"inputs": tensors, "means": [m.cpu() for m in means], "mean_devices": [str(m.device) for m in means],
            "sum": total.cpu(), "sum_device": str(total.device)}
