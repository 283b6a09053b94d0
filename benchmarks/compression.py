"""Gradient compression: unison's CommunicationOptions(compression=...) beside DDP's comm hooks (issue 14).

Two worker processes on this host (gloo, one thread each), workload W1 of
``multi_worker.py`` (MLP 784-1024-1024-10, 7.45 MB of float32 gradients, global batch 256,
SGD), five variants built from one seed in the same processes and timed in interleaved
rounds (the order rotating):

- ``ddp``: DistributedDataParallel, exact;
- ``ddp_fp16``: DDP with ``default_hooks.fp16_compress_hook`` (DDP refuses its
  ``bf16_compress_hook`` without CUDA and NCCL: "BF16 all reduce communication hook
  required CUDA 11+ and NCCL 2.10+", so on CPU float16 is the compression DDP has);
- ``unison_ring``: MultiWorkerMirroredStrategy exact over gloo (``implementation="RING"``),
  the uncompressed network baseline;
- ``unison_bf16`` / ``unison_fp16``: the same with ``compression="bf16"`` / ``"fp16"``;
- ``unison_powersgd``: unison's ``PowerSGD`` (rank 2, exact for the first 2 steps,
  error feedback and warm start). DDP's ``powerSGD_hook`` is not beside it: with the
  same settings on gloo it aborted the process here ("Received data size doesn't match
  expected size": its chained collectives, launched from future callbacks, met the
  next collective of the other worker in another order).

samples/s = 256 / median step time of worker 0; ratios are medians of per-round ratios.
After timing, unison fp16's weights are compared with DDP fp16's (both divide, round to
float16 and add; they should agree closely), unison exact's with DDP's (1e-5), and every
worker's weights with its peer's. Note that on one host unison's default (shared memory,
exact) is faster than any compression: compression is for the network between hosts.

Writes ``<out>/compression.json`` and ``<out>/compression.png``.

Usage:
    python benchmarks/compression.py [--rounds 8] [--steps 5] [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import describe, interleaved_rounds, machine_info  # noqa: E402

from multi_worker import GLOBAL_BATCH, _make_batches, _make_model, _make_step  # noqa: E402

VARIANTS = ("ddp", "ddp_fp16", "unison_ring", "unison_bf16", "unison_fp16", "unison_powersgd")
LABELS = {"ddp": "DDP", "ddp_fp16": "DDP\nfp16 hook", "unison_ring": "unison\nexact (gloo)",
          "unison_bf16": "unison\nbf16", "unison_fp16": "unison\nfp16",
          "unison_powersgd": "unison\nPowerSGD r2"}
POWERSGD_RANK, POWERSGD_START = 2, 2


def _strategy(rank: int, compression: Any) -> Any:
    import unison

    spec = unison.ClusterSpec({"worker": ["127.0.0.1:1", "127.0.0.1:2"]})
    options = unison.CommunicationOptions(implementation="RING", compression=compression, timeout_seconds=120)
    return unison.MultiWorkerMirroredStrategy(unison.SimpleClusterResolver(spec, task_type="worker", task_id=rank),
                                              communication_options=options)


def _worker(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    torch.set_num_threads(1)
    batches, loss_fn = _make_batches("W1", 4)
    per = GLOBAL_BATCH // world
    local = [(x[rank * per:(rank + 1) * per].clone(), y[rank * per:(rank + 1) * per].clone()) for x, y in batches]
    models: dict[str, nn.Module] = {}
    steps = {}
    import unison

    unison_powersgd = unison.PowerSGD(rank=POWERSGD_RANK, start_iter=POWERSGD_START)
    for name, compression in (("unison_ring", "none"), ("unison_bf16", "bf16"), ("unison_fp16", "fp16"),
                              ("unison_powersgd", unison_powersgd)):
        strategy = _strategy(rank, compression)
        with strategy.scope():
            models[name] = _make_model("W1")
            steps[name] = _make_step(models[name], torch.optim.SGD(models[name].parameters(), lr=0.01), loss_fn)
    for name in ("ddp", "ddp_fp16"):
        ddp = nn.parallel.DistributedDataParallel(_make_model("W1"))
        if name == "ddp_fp16":
            ddp.register_comm_hook(dist.group.WORLD, default_hooks.fp16_compress_hook)
        models[name] = ddp.module
        steps[name] = _make_step(ddp, torch.optim.SGD(ddp.parameters(), lr=0.01), loss_fn)
    samples, taken = interleaved_rounds({name: steps[name] for name in VARIANTS}, local, cfg)
    with torch.no_grad():
        weights = {name: [p.detach().clone() for p in model.parameters()] for name, model in models.items()}
    return {"samples": samples, "weights": weights, "steps_taken": taken}


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    data = results[0]["samples"]
    rows = {}
    for name in VARIANTS:
        step = describe([t for r in data[name] for t in r])
        rows[name] = {"median_step_ms": step["median"] * 1e3, "samples_per_s": GLOBAL_BATCH / step["median"]}

    def ratio(a: str, b: str) -> float:  # per round: b's step time / a's
        return statistics.median(statistics.median(y) / statistics.median(x) for x, y in zip(data[a], data[b]))

    weights = [r["weights"] for r in results]

    def diff(a: str, b: str, w: dict) -> float:
        return max((x - y).abs().max().item() for x, y in zip(w[a], w[b]))

    return {
        "variants": rows,
        "unison_fp16_vs_ddp_fp16": ratio("unison_fp16", "ddp_fp16"),
        "unison_bf16_vs_ddp_fp16": ratio("unison_bf16", "ddp_fp16"),
        "unison_bf16_vs_ddp": ratio("unison_bf16", "ddp"),
        "unison_powersgd_vs_ddp": ratio("unison_powersgd", "ddp"),
        "unison_ring_vs_ddp": ratio("unison_ring", "ddp"),
        "max_abs_weight_diff_unison_fp16_vs_ddp_fp16": diff("unison_fp16", "ddp_fp16", weights[0]),
        "max_abs_weight_diff_unison_ring_vs_ddp": diff("unison_ring", "ddp", weights[0]),
        "workers_equal": all(torch.equal(x, y) for name in VARIANTS
                             for x, y in zip(weights[0][name], weights[1][name])),
        "steps_taken": results[0]["steps_taken"],
    }


def plot(summary: dict[str, Any], path: Path, machine: dict[str, Any]) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - the bench extra
        return False
    values = [summary["variants"][n]["samples_per_s"] for n in VARIANTS]
    fig, ax = plt.subplots(figsize=(10, 4.2))
    bars = ax.bar([LABELS[n] for n in VARIANTS], values,
                  color=["#ee7733", "#ee9955", "#66ccee", "#4477aa", "#225588", "#113355"])
    for bar, value in zip(bars, values):
        ax.annotate(f"{value:.0f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom")
    ax.set_ylim(0, max(values) * 1.2)
    ax.set_ylabel("samples/s (median step)")
    ax.set_title(f"W1, 2 processes over gloo: unison fp16 = {summary['unison_fp16_vs_ddp_fp16']:.2f}x, bf16 = "
                 f"{summary['unison_bf16_vs_ddp_fp16']:.2f}x DDP's fp16 hook\n"
                 f"{machine['cpu_model']}, {machine['usable_cores']} cores, {machine['date'][:10]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8, help="interleaved rounds (default 8)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant per round (default 5)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first (default 3)")
    parser.add_argument("--quick", action="store_true", help="smoke mode: 2 rounds of 2 steps")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.warmup = 2, 2, 1
    cfg = {"rounds": args.rounds, "steps": args.steps, "warmup": args.warmup}
    from unison._testing import run_workers

    machine = machine_info()
    start = time.perf_counter()
    results = run_workers(_worker, 2, args=(cfg,), timeout=1800.0)
    summary = summarize(results)
    elapsed = time.perf_counter() - start
    print("W1 (MLP 784-1024-1024-10), global batch 256, 2 processes over gloo; samples/s = 256 / median step")
    for name in VARIANTS:
        row = summary["variants"][name]
        print(f"  {name:<12} {row['samples_per_s']:>8.0f} samples/s  ({row['median_step_ms']:.2f} ms)")
    print(f"unison fp16 / DDP fp16 hook: {summary['unison_fp16_vs_ddp_fp16']:.3f}   "
          f"unison bf16 / DDP fp16 hook: {summary['unison_bf16_vs_ddp_fp16']:.3f}   "
          f"unison bf16 / DDP exact: {summary['unison_bf16_vs_ddp']:.3f}   "
          f"unison exact (gloo) / DDP: {summary['unison_ring_vs_ddp']:.3f}   "
          f"unison PowerSGD r2 / DDP exact: {summary['unison_powersgd_vs_ddp']:.3f}")
    print(f"weights: unison fp16 vs DDP fp16 max |diff| {summary['max_abs_weight_diff_unison_fp16_vs_ddp_fp16']:.2e}; "
          f"unison exact vs DDP {summary['max_abs_weight_diff_unison_ring_vs_ddp']:.2e}; "
          f"workers equal: {'yes' if summary['workers_equal'] else 'NO'}")
    print(f"({elapsed:.0f} s; load average before {machine['load_average_1_5_15']})")
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"benchmark": "compression", "config": cfg, "summary": summary, "elapsed_s": elapsed, "machine": machine,
              "samples_rank0_s": results[0]["samples"]}
    (args.out / "compression.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out / 'compression.json'}")
    if plot(summary, args.out / "compression.png", machine):
        print(f"wrote {args.out / 'compression.png'}")
    ok = summary["workers_equal"] and summary["max_abs_weight_diff_unison_ring_vs_ddp"] <= 1e-5
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
