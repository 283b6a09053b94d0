"""Strategies on one GPU against plain PyTorch and DDP on the same GPU, in one process.

The GPU rows of the performance issue (run where a CUDA device is lent; the project's
tests do not need one). Workloads are ``in_process.py``'s -- ``W1`` (MLP
784-1024-1024-10, batch 256), ``W2`` (200 x Linear(64, 64), batch 256: many small
kernels, so per-op overhead), ``D`` (one Linear(10, 10), batch 8: per-step overhead) --
plus ``L`` (MLP 4096-4096-4096-4096, batch 4096: compute-bound), all on ``cuda:0``.

Variants, each a plain ``zero_grad(); loss.backward(); opt.step()`` with SGD:

- ``plain``: plain PyTorch on the GPU;
- ``one_device``: ``OneDeviceStrategy("cuda:0")``, the step through ``strategy.run``;
- ``mirrored``: ``MirroredStrategy(["cuda:0"])`` (one replica);
- ``mwms``: ``MultiWorkerMirroredStrategy`` in a cluster of one worker, NCCL group of 1
  (its gradient buckets go through ``dist.all_reduce`` as on many GPUs);
- ``ddp``: ``DistributedDataParallel`` over the same NCCL group of 1 (the peer).

Rounds interleave the variants (the order rotates each round); each times ``steps``
steps between two ``torch.cuda.synchronize()``. The reported ratio is the median over
rounds of plain's (or DDP's) step time over the variant's. After timing, every variant
trains a few float64 steps from the same weights and batches, and the largest weight
difference to plain's is reported.

Writes ``<out>/gpu.json``; exits 2 without a CUDA device.

Usage:
    python benchmarks/gpu.py [--rounds 10] [--workloads W1,W2,D,L] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _common import machine_info, max_weight_diffs, mse_sgd_step, rotating_rounds
from in_process import WORKLOADS as CPU_WORKLOADS
from torch import nn

import unison

WORKLOADS: dict[str, dict[str, Any]] = dict(CPU_WORKLOADS)
WORKLOADS["L"] = {"make": lambda: nn.Sequential(nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(),
                                                nn.Linear(4096, 4096)),
                  "batch": 4096, "inputs": 4096, "outputs": 4096, "steps": 10}
VARIANTS = ("plain", "one_device", "mirrored", "mwms", "ddp")
COMPRESSED = ("mwms_bf16", "ddp_bf16")
"""With ``--compression``: unison's ``compression="bf16"`` and DDP's ``bf16_compress_hook``."""
STRATEGY_VARIANTS = ("one_device", "mirrored", "mwms", "mwms_bf16")
DEVICE = "cuda:0"


def _batches(spec: dict[str, Any], dtype: torch.dtype, count: int = 4) -> list:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(spec["batch"], spec["inputs"], generator=g, dtype=dtype).to(DEVICE),
             torch.randn(spec["batch"], spec["outputs"], generator=g, dtype=dtype).to(DEVICE)) for _ in range(count)]


def _model(spec: dict[str, Any], dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return spec["make"]().to(dtype)  # drawn on the CPU in float32, the same for every variant


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Strategies:
    """The strategies, made once: the multi-worker one forms the NCCL group DDP then uses."""

    def __init__(self) -> None:
        self.one_device = unison.OneDeviceStrategy(DEVICE)
        self.mirrored = unison.MirroredStrategy([DEVICE])
        spec = unison.ClusterSpec({"worker": [f"127.0.0.1:{_free_port()}"]})
        resolver = unison.SimpleClusterResolver(spec, task_type="worker", task_id=0)
        self.mwms = unison.MultiWorkerMirroredStrategy(resolver, unison.CommunicationOptions(implementation="NCCL"),
                                                       devices=[DEVICE])
        _ = self.mwms.extended.cross_device_ops.worker_group  # the property forms the group now (on first use)
        assert dist.is_initialized() and dist.get_backend() == "nccl", "the NCCL group of one did not form"
        self.mwms_bf16 = unison.MultiWorkerMirroredStrategy(  # joins the same group
            resolver, unison.CommunicationOptions(implementation="NCCL", compression="bf16"), devices=[DEVICE])


def make_step(variant: str, spec: dict[str, Any], strategies: Strategies,
              dtype: torch.dtype = torch.float32) -> tuple[Callable, nn.Module]:
    """``step(x, y)`` training one batch under ``variant``, and its model."""
    strategy = getattr(strategies, variant) if variant in STRATEGY_VARIANTS else None
    if strategy is None:
        model = _model(spec, dtype).to(DEVICE)
        if variant.startswith("ddp"):
            model = nn.parallel.DistributedDataParallel(model, device_ids=[0])
        if variant == "ddp_bf16":
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

            model.register_comm_hook(None, bf16_compress_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
    else:
        with strategy.scope():
            model = _model(spec, dtype)
            opt = torch.optim.SGD(model.parameters(), lr=0.01)

    train = mse_sgd_step(model, opt)
    if strategy is None:
        return train, model
    run = strategy.run
    return (lambda x, y: run(train, args=(x, y))), model


def _time(step: Callable, batches: list, steps: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(steps):
        step(*batches[i % len(batches)])
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def measure(name: str, rounds: int, strategies: Strategies, variants: tuple[str, ...] = VARIANTS) -> dict[str, Any]:
    spec = WORKLOADS[name]
    batches = _batches(spec, torch.float32)
    steps = {variant: make_step(variant, spec, strategies)[0] for variant in variants}
    for step in steps.values():
        _time(step, batches, max(3, spec["steps"] // 2))  # warm-up: kernels, buckets, NCCL communicators
    samples = rotating_rounds(variants, lambda variant: _time(steps[variant], batches, spec["steps"] * 2), rounds)
    summary = {
        variant: {
            "median_step_ms": statistics.median(values) * 1e3,
            "samples_per_s_vs_plain": statistics.median(p / v for p, v in zip(samples["plain"], values)),
            "samples_per_s_vs_ddp": statistics.median(d / v for d, v in zip(samples["ddp"], values)),
        }
        for variant, values in samples.items()
    }
    return {"summary": summary, "samples_step_s": samples,
            "max_weight_diff_vs_plain": weight_diffs(spec, strategies, variants)}


def weight_diffs(spec: dict[str, Any], strategies: Strategies, variants: tuple[str, ...],
                 steps: int = 5) -> dict[str, float]:
    """Largest |weight - plain weight| after a few float64 steps from the same start."""
    return max_weight_diffs(lambda variant: make_step(variant, spec, strategies, torch.float64), variants,
                            _batches(spec, torch.float64), steps)


def profile(name: str, variants: list[str], strategies: Strategies, steps: int = 200) -> None:
    """Prints where ``variants`` spend host time on workload ``name`` (torch.profiler, CPU side):
    the ops with the most self CPU time, host-device synchronisations among them."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    spec = WORKLOADS[name]
    batches = _batches(spec, torch.float32)
    for variant in variants:
        step = make_step(variant, spec, strategies)[0]
        _time(step, batches, 20)
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            _time(step, batches, steps)
        print(f"--- {name} {variant}: {steps} steps")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=48))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds per workload (default 10)")
    parser.add_argument("--workloads", default="W1,W2,D,L", help="comma-separated subset of W1,W2,D,L")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out",
                        help="output folder (default benchmarks/out)")
    parser.add_argument("--profile", default="", metavar="WORKLOAD:VARIANT,...",
                        help="only profile these variants on a workload (e.g. D:mwms,ddp), print the tables")
    parser.add_argument("--compression", action="store_true",
                        help="also time unison's bf16 compression beside DDP's bf16_compress_hook")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        parser.error(f"--workloads: unknown {unknown!r}; choose from {list(WORKLOADS)!r}")
    if not torch.cuda.is_available():
        print("benchmarks/gpu.py needs a CUDA device; this machine has none", file=sys.stderr)
        return 2
    strategies = Strategies()
    if args.profile:
        workload, _, variants = args.profile.partition(":")
        profile(workload, variants.split(","), strategies)
        dist.destroy_process_group()
        return 0
    info = machine_info()
    info["gpu"] = torch.cuda.get_device_name(0)
    info["cuda"] = torch.version.cuda
    info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    results: dict[str, Any] = {}
    print(f"{'workload':<9} {'variant':<11} {'ms/step':>9} {'x plain':>8} {'x ddp':>7} {'max |w - plain|':>16}")
    for name in names:
        results[name] = measure(name, args.rounds, strategies, VARIANTS + (COMPRESSED if args.compression else ()))
        for variant, row in results[name]["summary"].items():
            print(f"{name:<9} {variant:<11} {row['median_step_ms']:>9.3f} {row['samples_per_s_vs_plain']:>8.3f} "
                  f"{row['samples_per_s_vs_ddp']:>7.3f} {results[name]['max_weight_diff_vs_plain'][variant]:>16.2e}",
                  flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu.json").write_text(json.dumps({"machine": info, "rounds": args.rounds, "results": results},
                                                  indent=2))
    print(f"wrote {args.out / 'gpu.json'}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
