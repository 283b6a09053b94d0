"""Memory of dynamic embedding tables on ps tasks: 2 GB of rows and Adagrad state over 2 ps tasks.

A chief (this process), one worker and two ps tasks, each a process of its own. One
``unison.DynamicEmbedding(64)`` trained by Adagrad (a row and its accumulator: 512 bytes)
grows by ``--ids-per-step`` new ids per scheduled step until rows and state total
``--gigabytes``. Measured from ``/proc``: the worker's peak resident set (VmHWM) over
its own after two warm steps, and each ps task's resident set growth over the same
point, against the bytes of the rows and state it gained (``DynamicEmbedding.table_stats``
counts those on each ps task). Goals (issue 33): worker growth under 64 MB; ps growth
under 1.5x its rows and state.

Writes ``<out>/recsys_memory.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info  # noqa: E402
from parameter_server import _start_cluster  # noqa: E402

import unison  # noqa: E402

DIM = 64
ROW_AND_STATE_BYTES = DIM * 4 * 2


def _status_kb(pid: int | str, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _worker_peak_kb() -> int:
    return _status_kb("self", "VmHWM")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gigabytes", type=float, default=2.0, help="rows and optimizer state over all ps tasks")
    parser.add_argument("--ids-per-step", type=int, default=1 << 17)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()
    steps = int(args.gigabytes * 2**30 // (args.ids_per_step * ROW_AND_STATE_BYTES))
    resolver, procs = _start_cluster(1, 2)
    pids = {name: proc.pid for proc, name in procs}
    try:
        strategy = unison.ParameterServerStrategy(resolver, timeout_seconds=120)
        coordinator = unison.ClusterCoordinator(strategy)
        with strategy.scope():
            table = unison.DynamicEmbedding(DIM, initializer=unison.embeddings.Uniform(-0.05, 0.05))
            optimizer = torch.optim.Adagrad(table.parameters(), lr=0.05)
        per_step = args.ids_per_step

        def step(first: int) -> int:
            ids = (torch.arange(first, first + per_step) * 2654435761) ^ (1 << 62)  # new ids, spread over int64
            optimizer.zero_grad()
            table(ids).square().sum().backward()
            optimizer.step()
            return _worker_peak_kb()

        for warm in range(2):
            coordinator.schedule(step, args=(-(warm + 1) * per_step,)).fetch()
        worker_base = coordinator.schedule(step, args=(-3 * per_step,)).fetch()
        ps_names = ["ps:0", "ps:1"]
        ps_base = {name: _status_kb(pids[name], "VmRSS") for name in ps_names}
        rows_base = [s["rows"] for s in table.table_stats()]
        start, worker_peak = time.perf_counter(), worker_base
        for i in range(steps):
            worker_peak = max(worker_peak, coordinator.schedule(step, args=(i * per_step,)).fetch())
            if (i + 1) % 8 == 0 or i + 1 == steps:
                held = sum(s["rows"] for s in table.table_stats()) - sum(rows_base)
                print(f"step {i + 1}/{steps}: {held * ROW_AND_STATE_BYTES / 2**30:.2f} GB of rows and state added, "
                      f"{time.perf_counter() - start:.0f} s", flush=True)
        stats = table.table_stats()
        ps = []
        for name, stat, before in zip(ps_names, stats, rows_base):
            added = (stat["rows"] - before) * ROW_AND_STATE_BYTES
            grew = (_status_kb(pids[name], "VmRSS") - ps_base[name]) * 1024
            ps.append({"task": name, "rows": stat["rows"], "table_bytes": stat["bytes"],
                       "rows_and_state_added_mb": added / 2**20, "rss_growth_mb": grew / 2**20,
                       "rss_growth_per_rows_and_state": grew / added,
                       "rss_mb": _status_kb(pids[name], "VmRSS") / 1024,
                       "peak_rss_mb": _status_kb(pids[name], "VmHWM") / 1024})
        result = {
            "machine": machine_info(), "dim": DIM, "ids_per_step": per_step, "steps": steps,
            "rows_and_state_gb": sum(p["rows_and_state_added_mb"] for p in ps) / 1024,
            "worker_peak_growth_mb": (worker_peak - worker_base) / 1024, "worker_peak_mb": worker_peak / 1024,
            "ps": ps, "seconds": time.perf_counter() - start,
        }
        coordinator.shutdown()
    finally:
        for proc, _ in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "recsys_memory.json").write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=2))


if __name__ == "__main__":
    main()
