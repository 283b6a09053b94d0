"""What unison's gradient synchronisation adds to a step, with no DDP in the run (issue 32).

``multi_worker.py`` compares unison with DDP in rounds of a few hundred steps, where this
VM's drift between fast and slow states decides much of a ratio. This measures one
thing more steadily: in the same two worker processes, blocks of ``--steps`` steps of
``no_sync`` (each worker training its own model, never communicating) and of ``unison``
(``MultiWorkerMirroredStrategy`` with its defaults: shared memory between the two workers
of this host) alternate ``--blocks`` times; the result is the mean time a step takes in
each, and their difference: unison's own work plus waiting for the slower worker.
Run it against two trees (``PYTHONPATH=<tree>/src``), alternating, to compare them.

Workloads are ``multi_worker.py``'s (W1, W2, D). Writes ``<out>/sync_overhead.json``.

Usage:
    python benchmarks/sync_overhead.py [--workload D] [--steps 3000] [--blocks 3] [--out DIR]
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
from _common import machine_info

import multi_worker


def _worker(rank: int, world_size: int, cfg: dict) -> dict[str, Any]:
    torch.set_num_threads(1)  # two processes on two cores
    workload = cfg["workload"]
    strategy = multi_worker._strategy(rank, {"bytes_per_pack": 0, "collective_timeout": 120.0})
    batches, loss_fn = multi_worker._make_batches(workload, 8)
    per = multi_worker.BATCHES[workload] // world_size
    local = [(x[rank * per:(rank + 1) * per].clone(), y[rank * per:(rank + 1) * per].clone()) for x, y in batches]
    with strategy.scope():
        model = multi_worker._make_model(workload)
        opt = torch.optim.SGD(model.parameters(), lr=multi_worker.LR)
    alone = multi_worker._make_model(workload)
    steps = {"unison": multi_worker._make_step(model, opt, loss_fn),
             "no_sync": multi_worker._make_step(alone, torch.optim.SGD(alone.parameters(), lr=multi_worker.LR),
                                                loss_fn)}
    for i in range(cfg["warmup"]):
        for step in steps.values():
            step(*local[i % len(local)])
    means: dict[str, list[float]] = {name: [] for name in steps}
    for block in range(cfg["blocks"]):
        for name in (("no_sync", "unison") if block % 2 == 0 else ("unison", "no_sync")):
            dist.barrier()
            start = time.perf_counter()
            for i in range(cfg["steps"]):
                steps[name](*local[i % len(local)])
            means[name].append((time.perf_counter() - start) / cfg["steps"])
    return {"means_s": means}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="D", choices=sorted(multi_worker.WORKLOADS))
    parser.add_argument("--steps", type=int, default=3000, help="steps per block (default 3000; W1/W2: use ~150)")
    parser.add_argument("--blocks", type=int, default=3, help="alternating blocks per variant (default 3)")
    parser.add_argument("--warmup", type=int, default=200, help="untimed steps of each variant first")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    args = parser.parse_args(argv)
    cfg = {"workload": args.workload, "steps": args.steps, "blocks": args.blocks, "warmup": args.warmup}
    from unison._testing import run_workers

    machine = machine_info()
    results = run_workers(_worker, 2, args=(cfg,), timeout=1800.0)
    per_rank = [{name: statistics.mean(values) * 1e6 for name, values in r["means_s"].items()} for r in results]
    summary = {f"rank{rank}": {**us, "overhead_us": us["unison"] - us["no_sync"]} for rank, us in enumerate(per_rank)}
    for rank, row in summary.items():
        print(f"{args.workload} {rank}: no_sync {row['no_sync']:.1f} us/step, unison {row['unison']:.1f}, "
              f"above no_sync {row['overhead_us']:.1f}")
    print(f"(load average before {machine['load_average_1_5_15']}, torch {machine['torch']}, unison from "
          f"{Path(sys.modules['unison'].__file__).parent})")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "sync_overhead.json"
    path.write_text(json.dumps({"benchmark": "sync_overhead", "config": cfg, "summary": summary,
                                "samples_s": [r["means_s"] for r in results], "machine": machine}, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
