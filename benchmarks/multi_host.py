"""Two simulated hosts x two workers: unison's hierarchical all-reduce vs flat gloo vs DDP (issue 15).

Each simulated host is a Linux network namespace with its own address and its own
``/dev/shm`` (``unison._testing.hosts.SimulatedHosts``; needs root). One ``unison
launch --nnodes 2 --node-rank R --workers-per-node 2`` per host starts four workers
(``_multi_host_worker.py``), each of which trains, in the same process and from one seed:

- ``hierarchical``: ``MultiWorkerMirroredStrategy`` with its defaults. With two hosts of
  two workers it picks the hierarchical transport: each host sums its workers'
  gradient buckets in shared memory, the two hosts' leaders all-reduce the sums over
  gloo, and each host's workers copy the total out;
- ``ring``: the same with ``CommunicationOptions(implementation="RING")``: every bucket
  over gloo between all four workers;
- ``ddp``: ``DistributedDataParallel`` with its defaults on the same group.

Workloads as in ``multi_worker.py``: W1 (MLP 784-1024-1024-10, 7.45 MB of gradients)
and W2 (200 x Linear(64, 64), 400 gradients, 3.33 MB), global batch 256 (64 per
worker), SGD. Rounds alternate the variants in rotating order; samples/s = 256 / median
step time of worker 0; ratios are medians of per-round ratios. After timing, both
unison models must equal DDP's (same steps, same data) within 1e-5.

By default the run is repeated with the hosts' links unlimited (a veth pair: memory
speed, which flatters the network), and limited to 1 Gbit/s and to 250 Mbit/s each way
(``tc tbf``), as a real network is slower than memory. At 250 Mbit/s, sending W2's
gradients between these slow hosts takes about as long as computing them, as where the
gradient exchange is a large share of a real cluster's step. Each row also says how busy
the machine's cores were: where they are busy under every variant (four workers on two
cores), a step costs its CPU work whatever the transport saves on the wire. Goal:
hierarchical >= 1.3 x DDP on W2.

Writes ``<out>/multi_host.json`` and ``<out>/multi_host.png``; exit code 1 only when
weights differ or a launch fails, never for a missed goal.

Usage:
    sudo python benchmarks/multi_host.py [--links none,1gbit] [--rounds 8] [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import describe, machine_info  # noqa: E402

from unison._testing.hosts import SimulatedHosts, unavailable_reason  # noqa: E402

HERE = Path(__file__).resolve().parent
WORKER = str(HERE / "_multi_host_worker.py")
GLOBAL_BATCH = 256
GOAL_W2 = 1.3
TOLERANCE = 1e-5
WORKLOADS = {"W1": "MLP 784-1024-1024-10", "W2": "200 x Linear(64, 64), residual"}
VARIANTS = ("ddp", "hierarchical", "ring", "no_sync")


def run_link(link: str, cfg: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Launches the four workers on two fresh simulated hosts; returns every worker's result."""
    rate = None if link == "none" else link
    with SimulatedHosts(2, shm_size="1g", link_rate=rate) as hosts, tempfile.TemporaryDirectory() as out:
        launchers = [
            hosts.popen(node, [
                sys.executable, "-m", "unison.launch", "--nnodes", "2", "--node-rank", str(node),
                "--master-addr", hosts.address(0), "--workers-per-node", "2", "--rendezvous-timeout", "60",
                WORKER, out, json.dumps(cfg),
            ], cwd=str(HERE.parent))
            for node in range(2)
        ]  # fmt: skip
        outputs = []
        for launcher in launchers:
            try:
                outputs.append(launcher.communicate(timeout=timeout)[0])
            except Exception:  # noqa: BLE001 - a hung run: the hosts' exit kills it
                outputs.append("(timed out)")
        codes = [launcher.returncode for launcher in launchers]
        results = []
        for rank in range(4):
            path = Path(out) / f"worker:{rank}.json"
            results.append(json.loads(path.read_text()) if path.exists() else None)
    if codes != [0, 0] or None in results:
        raise RuntimeError(f"link {link}: the launchers exited {codes}; output:\n" + "\n".join(outputs))
    return {"results": results}


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    """Samples/s, per-round ratios and checks from worker 0's timings (weights from all)."""
    rank0 = run["results"][0]["train"]
    out: dict[str, Any] = {}
    for workload, data in rank0.items():
        rows = {}
        for name in VARIANTS:
            step = describe([t for r in data["samples"][name] for t in r])
            rows[name] = {"median_step_ms": step["median"] * 1e3, "samples_per_s": GLOBAL_BATCH / step["median"],
                          "steps_timed": step["n"]}
        ratios = {}
        for name in ("hierarchical", "ring", "no_sync"):
            per_round = [statistics.median(d) / statistics.median(u)
                         for d, u in zip(data["samples"]["ddp"], data["samples"][name])]
            ratios[name] = {"median": statistics.median(per_round), "rounds": per_round}
        diff = max(r["train"][workload]["weight_diff_vs_ddp"][n]
                   for r in run["results"] for n in ("hierarchical", "ring"))
        transports = {r["task"]: r["train"][workload]["transports"] for r in run["results"]}
        out[workload] = {
            "model": WORKLOADS[workload], "variants": rows,
            "hierarchical_vs_ddp": ratios["hierarchical"]["median"], "ring_vs_ddp": ratios["ring"]["median"],
            "no_sync_vs_ddp": ratios["no_sync"]["median"],
            "round_ratios": {n: r["rounds"] for n, r in ratios.items()},
            "max_abs_weight_diff_vs_ddp": diff,
            "cores_busy": run["results"][0]["train"][workload]["cores_busy"], "weights_match_ddp": diff <= TOLERANCE,
            "transports": transports,
            "hierarchical_chosen": all(t["hierarchical"] == "HierarchicalTransport" for t in transports.values()),
        }
        if workload == "W2":
            out[workload]["goal"] = GOAL_W2
            out[workload]["pass"] = ratios["hierarchical"]["median"] >= GOAL_W2
    return out


def format_table(summaries: dict[str, dict[str, Any]]) -> str:
    lines = [
        "2 simulated hosts x 2 workers, global batch 256, SGD; samples/s = 256 / median step time (worker 0);",
        "ratios: medians over rounds of DDP's step time / the variant's (> 1: faster than DDP);",
        "no_sync: each worker trains alone, no gradient exchange (the ceiling of any data-parallel run here);",
        "busy: share of the machine's CPU time busy during DDP's / hierarchical's steps (near 100%: CPU-bound)",
        f"{'link':<8} {'workload':<8} {'ddp':>8} {'hier.':>8} {'ring':>8} {'hier/ddp':>9} {'ring/ddp':>9} "
        f"{'weights':>8} {'goal':>10} {'no_sync/ddp':>11} {'busy':>9}",
    ]
    for link, summary in summaries.items():
        for workload, row in summary.items():
            v = row["variants"]
            goal = (f">={row['goal']:.1f} {'PASS' if row['pass'] else 'FAIL'}") if "goal" in row else ""
            lines.append(
                f"{link:<8} {workload:<8} {v['ddp']['samples_per_s']:>8.0f} {v['hierarchical']['samples_per_s']:>8.0f} "
                f"{v['ring']['samples_per_s']:>8.0f} {row['hierarchical_vs_ddp']:>9.3f} {row['ring_vs_ddp']:>9.3f} "
                f"{'equal' if row['weights_match_ddp'] else 'DIFFER':>8} {goal:>10} {row['no_sync_vs_ddp']:>11.3f} "
                f"{row['cores_busy']['ddp']:>4.0%}/{row['cores_busy']['hierarchical']:>4.0%}"
            )
    chosen = all(row["hierarchical_chosen"] for s in summaries.values() for row in s.values())
    lines.append(f"the default strategy chose the hierarchical transport on every worker: {'yes' if chosen else 'NO'}")
    return "\n".join(lines)


def plot(summaries: dict[str, dict[str, Any]], path: Path, machine: dict[str, Any]) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - the bench extra
        print("matplotlib is not installed (pip install unison[bench]): no chart written", file=sys.stderr)
        return False
    panels = [(link, workload) for link, s in summaries.items() for workload in s]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.2), squeeze=False)
    colors = {"ddp": "#ee7733", "hierarchical": "#4477aa", "ring": "#66ccee", "no_sync": "#cccccc"}
    for ax, (link, workload) in zip(axes[0], panels):
        row = summaries[link][workload]
        values = [row["variants"][n]["samples_per_s"] for n in VARIANTS]
        bars = ax.bar(["DDP", "unison\nhierarchical", "unison\nRING", "no sync\n(ceiling)"], values,
                      color=[colors[n] for n in VARIANTS])
        notes = [f"{values[0]:.0f}", f"{values[1]:.0f}\n{row['hierarchical_vs_ddp']:.2f}x",
                 f"{values[2]:.0f}\n{row['ring_vs_ddp']:.2f}x", f"{values[3]:.0f}\n{row['no_sync_vs_ddp']:.2f}x"]
        for bar, note in zip(bars, notes):
            ax.annotate(note, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                        fontsize=8)
        ax.set_ylim(0, max(values) * 1.3)
        ax.set_title(f"{workload} ({row['model']})\nlink: {'unlimited veth' if link == 'none' else link}", fontsize=9)
        ax.set_ylabel("samples/s")
    fig.suptitle(f"2 simulated hosts x 2 workers -- {machine['cpu_model']}, {machine['usable_cores']} cores, "
                 f"{machine['date'][:10]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--links", default="none,1gbit,250mbit",
                        help="comma-separated link settings, 'none' or a tc rate such as 1gbit "
                             "(default none,1gbit,250mbit)")
    parser.add_argument("--workloads", default="W1,W2", help="comma-separated, of W1, W2 (default both)")
    parser.add_argument("--rounds", type=int, default=8, help="interleaved rounds (default 8)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant per round (default 5)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first (default 3)")
    parser.add_argument("--quick", action="store_true", help="smoke mode: 2 rounds of 2 steps, W2 only, no link limit")
    parser.add_argument("--out", type=Path, default=HERE / "out", help="output folder (default benchmarks/out)")
    args = parser.parse_args(argv)
    reason = unavailable_reason()
    if reason is not None:
        print(f"multi_host.py needs simulated hosts, which this machine cannot make: {reason}", file=sys.stderr)
        return 2
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    links = [link.strip() for link in args.links.split(",") if link.strip()]
    if args.quick:
        args.rounds, args.steps, args.warmup, workloads, links = 2, 2, 1, ["W2"], ["none"]
    bad = [w for w in workloads if w not in WORKLOADS]
    if bad or not workloads:
        parser.error(f"--workloads: unknown {bad or args.workloads!r}; choose from W1, W2")
    cfg = {"workloads": workloads, "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup,
           "num_batches": 4, "timeout": 120.0}
    machine = machine_info()
    start = time.perf_counter()
    summaries, raw = {}, {}
    for link in links:
        print(f"link {link}: launching 2 hosts x 2 workers ...", flush=True)
        run = run_link(link, cfg, timeout=600.0)
        raw[link] = [r["train"] for r in run["results"][:1]]
        summaries[link] = summarize(run)
    elapsed = time.perf_counter() - start
    print(format_table(summaries))
    print(f"({elapsed:.0f} s; {machine['cpu_model']}, {machine['usable_cores']} usable cores, load average before "
          f"{machine['load_average_1_5_15']}, torch {machine['torch']})")
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"benchmark": "multi_host", "command": "python benchmarks/multi_host.py " + " ".join(
        sys.argv[1:] if argv is None else argv), "config": {**cfg, "links": links, "global_batch": GLOBAL_BATCH,
        "hosts": 2, "workers_per_host": 2, "threads_per_process": 1}, "summary": summaries,
        "samples_worker0_s": raw, "elapsed_s": elapsed, "machine": machine}  # fmt: skip
    json_path = args.out / "multi_host.json"
    json_path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {json_path}")
    png_path = args.out / "multi_host.png"
    if plot(summaries, png_path, machine):
        print(f"wrote {png_path}")
    correct = all(row["weights_match_ddp"] for s in summaries.values() for row in s.values())
    return 0 if correct else 1


if __name__ == "__main__":
    sys.exit(main())
