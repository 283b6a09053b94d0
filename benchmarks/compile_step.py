"""torch.compile benchmark: a compiled vs an eager training step, under unison MultiWorkerMirroredStrategy and
under DDP.

One command, one run, two worker processes (gloo, one intra-op thread each). Four
variants train the same MLP (784-512-512-512-10, cross-entropy, SGD lr 0.01, global batch
256, 128 per worker) *interleaved in the same two processes*:

- ``unison_eager``: built in ``MultiWorkerMirroredStrategy.scope()`` (defaults: the two
  workers of this host meet in shared memory), a plain ``zero_grad / backward / step`` in
  ``strategy.run``;
- ``unison_compiled``: the same with ``torch.compile(model)`` (``--backend``, inductor by
  default). unison all-reduces from the parameters' post-accumulate-grad hooks, which fire
  only once the compiled backward node has produced every gradient: no bucket overlaps the
  backward computation (``tests/multi_worker/test_torch_compile_workers.py``);
- ``unison_compiled_split``: compiled with ``strategy.extended.compile_backend(backend)``,
  which splits the graph at the bucket size (DDPOptimizer) where buckets leave during
  backward (``--implementation RING``: flat gloo), so they overlap the compiled backward
  again; with shared memory (AUTO on one host, every bucket reduced at the end) it is the
  plain backend, the same as ``unison_compiled``;
- ``ddp_eager``: ``DistributedDataParallel`` with its defaults;
- ``ddp_compiled``: ``torch.compile(ddp_model)``, where Dynamo's DDPOptimizer splits the
  graph at DDP's bucket boundaries so that buckets leave while backward runs.

Each unison variant has its own strategy (its gradient buckets then hold only its model's
parameters). After an untimed warm-up (which includes compilation), rounds time every
variant in turn (order rotating, ``_common.interleaved_rounds``). Reported: per-step
medians, and the ratios compiled/eager (for unison and for DDP) and unison/DDP (eager and
compiled), from the medians and per round (paired). After timing, every variant has taken
the same steps on the same data and their weights are compared (tolerance 1e-4: inductor
may reorder floating-point sums); the exit code is 1 only if they differ. Performance is
reported, never asserted.

Writes ``<out>/compile_step.json`` (samples of rank 0, summary, machine) and prints the
summary as JSON.

Usage:
    python benchmarks/compile_step.py [--steps N] [--rounds R] [--warmup W] [--backend B]
                                      [--implementation AUTO|RING] [--quick] [--out DIR]
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
from _common import describe, interleaved_rounds, machine_info
from torch import nn

WORLD_SIZE = 2
GLOBAL_BATCH = 256
LR = 0.01
WEIGHT_TOLERANCE = 1e-4
VARIANTS = ("unison_eager", "unison_compiled", "unison_compiled_split", "ddp_eager", "ddp_compiled")


def _make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512),
                         nn.ReLU(), nn.Linear(512, 10))


def _strategy(rank: int, timeout: float, implementation: str) -> Any:
    import unison

    spec = unison.ClusterSpec({"worker": ["127.0.0.1:1", "127.0.0.1:2"]})  # rendezvous via UNISON_RENDEZVOUS
    options = unison.CommunicationOptions(timeout_seconds=timeout, implementation=implementation)
    return unison.MultiWorkerMirroredStrategy(unison.SimpleClusterResolver(spec, task_type="worker", task_id=rank),
                                              options)


def _step(model: Any, opt: torch.optim.Optimizer, strategy: Any = None) -> Any:
    def train(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    if strategy is None:
        return train
    return lambda x, y: strategy.run(train, args=(x, y))


def _worker(rank: int, world_size: int, cfg: dict) -> dict[str, Any]:
    import warnings

    import torch._inductor.config

    torch.set_num_threads(1)
    # Compile in this process: inductor's pool of compile subprocesses buys nothing on 2
    # cores, and a worker's pool outliving a failed run would be a leak.
    torch._inductor.config.compile_threads = 1
    g = torch.Generator().manual_seed(1)
    per = GLOBAL_BATCH // world_size
    batches = [(torch.randn(GLOBAL_BATCH, 784, generator=g)[rank * per:(rank + 1) * per].clone(),
                torch.randint(0, 10, (GLOBAL_BATCH,), generator=g)[rank * per:(rank + 1) * per].clone())
               for _ in range(8)]
    models: dict[str, nn.Module] = {}
    steps = {}
    for name in ("unison_eager", "unison_compiled", "unison_compiled_split"):
        strategy = _strategy(rank, cfg["collective_timeout"], cfg["implementation"])  # the first forms the group
        with strategy.scope():
            models[name] = _make_model()
            opt = torch.optim.SGD(models[name].parameters(), lr=LR)
        forward: Any = models[name]
        if name == "unison_compiled":
            forward = torch.compile(models[name], backend=cfg["backend"])
        elif name == "unison_compiled_split":
            forward = torch.compile(models[name], backend=strategy.extended.compile_backend(cfg["backend"]))
        steps[name] = _step(forward, opt, strategy)
    for name in ("ddp_eager", "ddp_compiled"):
        models[name] = _make_model()
        with warnings.catch_warnings():  # torch 2.13 deprecates the name; its successor still syncs at init
            warnings.simplefilter("ignore", FutureWarning)
            ddp = nn.parallel.DistributedDataParallel(models[name])  # on the group unison formed
        forward = torch.compile(ddp, backend=cfg["backend"]) if name.endswith("compiled") else ddp
        steps[name] = _step(forward, torch.optim.SGD(models[name].parameters(), lr=LR))
    compile_start = time.perf_counter()
    samples, taken = interleaved_rounds(steps, batches, cfg)
    warmup_and_timing_s = time.perf_counter() - compile_start
    weights = {name: [p.detach().clone() for p in model.parameters()] for name, model in models.items()}
    reference = weights["unison_eager"]
    diffs = {name: max((a - b).abs().max().item() for a, b in zip(w, reference)) for name, w in weights.items()}
    return {"samples": samples, "taken": taken, "weight_diffs": diffs, "elapsed_s": warmup_and_timing_s}


def _ratio(num: list[list[float]], den: list[list[float]]) -> dict[str, float]:
    """num/den of the per-step medians, and the median of per-round ratios (paired)."""
    flat_num = [t for block in num for t in block]
    flat_den = [t for block in den for t in block]
    paired = [statistics.median(a) / statistics.median(b) for a, b in zip(num, den)]
    return {"of_medians": statistics.median(flat_num) / statistics.median(flat_den),
            "paired": statistics.median(paired)}


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    samples = results[0]["samples"]
    per_step_ms = {name: describe([1e3 * t for block in samples[name] for t in block]) for name in VARIANTS}
    diffs = {name: max(r["weight_diffs"][name] for r in results) for name in VARIANTS}
    return {
        "per_step_ms_rank0": per_step_ms,
        "ratios": {
            "unison_compiled_over_eager": _ratio(samples["unison_compiled"], samples["unison_eager"]),
            "unison_compiled_split_over_eager": _ratio(samples["unison_compiled_split"], samples["unison_eager"]),
            "unison_split_over_ddp_compiled": _ratio(samples["unison_compiled_split"], samples["ddp_compiled"]),
            "ddp_compiled_over_eager": _ratio(samples["ddp_compiled"], samples["ddp_eager"]),
            "unison_over_ddp_eager": _ratio(samples["unison_eager"], samples["ddp_eager"]),
            "unison_over_ddp_compiled": _ratio(samples["unison_compiled"], samples["ddp_compiled"]),
        },
        "max_weight_diff_vs_unison_eager": diffs,
        "weights_match": all(d <= WEIGHT_TOLERANCE for d in diffs.values()),
        "steps_taken": results[0]["taken"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant per round (default 10)")
    parser.add_argument("--rounds", type=int, default=20, help="interleaved rounds (default 20)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per variant first, compilation included")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (default inductor)")
    parser.add_argument("--implementation", default="AUTO", choices=("AUTO", "RING"),
                        help="unison's CommunicationImplementation: AUTO (one host: shared memory) or RING (gloo)")
    parser.add_argument("--quick", action="store_true", help="smoke mode: 2 rounds of 2 steps, 2 warm-up steps")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out",
                        help="output folder (default benchmarks/out)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.rounds, args.warmup = 2, 2, 2
    cfg = {"steps": args.steps, "rounds": args.rounds, "warmup": args.warmup, "backend": args.backend,
           "implementation": args.implementation, "collective_timeout": 300.0}
    from unison._testing import run_workers

    machine = machine_info()  # before the run: the load average then says what else was running
    start = time.perf_counter()
    results = run_workers(_worker, WORLD_SIZE, args=(cfg,), timeout=1800.0)
    elapsed = time.perf_counter() - start
    summary = summarize(results)
    print(json.dumps(summary, indent=1))
    print(f"({elapsed:.0f} s; {machine['cpu_model']}, {machine['usable_cores']} usable cores, "
          f"load average before {machine['load_average_1_5_15']}, torch {machine['torch']})")
    args.out.mkdir(parents=True, exist_ok=True)
    record = {
        "benchmark": "compile_step",
        "command": "python benchmarks/compile_step.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "config": {**cfg, "global_batch": GLOBAL_BATCH, "world_size": WORLD_SIZE, "optimizer": f"SGD(lr={LR})",
                   "model": "MLP 784-512-512-512-10", "threads_per_process": 1},
        "summary": summary,
        "samples_rank0_s": results[0]["samples"],
        "elapsed_s": elapsed,
        "machine": machine,
    }
    json_path = args.out / "compile_step.json"
    json_path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {json_path}")
    return 0 if summary["weights_match"] else 1


if __name__ == "__main__":
    sys.exit(main())
