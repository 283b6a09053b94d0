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
cores), a step costs its CPU work whatever the transport saves on the wire. Goals (issue 45),
hierarchical / DDP on W1 and W2: >= 1.0 with the links unlimited, >= 1.3 at 250 Mbit/s (the
other links have none).

Writes ``<out>/multi_host.json`` and ``<out>/multi_host.png``; exit code 1 only when
weights differ or a launch fails, never for a missed goal.

``--suite compression`` (issue 45) measures gradient compression where it is meant to
pay, on the slow link between the hosts: unison's hierarchical transport exact, and with
bf16, fp16, PowerSGD rank 1 and rank 4 (compressing what crosses hosts), beside DDP exact
and with DDP's own communication hooks for each, on W1, W2 and a TransformerEncoder
language model (LM), at 100 Mbit/s, 250 Mbit/s and 1 Gbit/s by default; then, once, on
the unlimited link, the held-out accuracy of the digits of ``examples/digits.py`` trained
exact and under each compression. Writes ``multi_host_compression.json`` and ``.png``
(``_multi_host_compression.py`` says what runs and how DDP's hooks are set).

Usage:
    sudo python benchmarks/multi_host.py [--links none,1gbit] [--rounds 8] [--quick] [--out DIR]
    sudo python benchmarks/multi_host.py --suite compression [--links 100mbit,250mbit,1gbit] [--quick]
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
GOALS = {"none": 1.0, "250mbit": 1.3}
"""Hierarchical / DDP on W1 and W2, by link (issue 45); the other links have no goal."""
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


def summarize(run: dict[str, Any], link: str) -> dict[str, Any]:
    """Samples/s, per-round ratios and checks from worker 0's timings (weights from all); the goal
    of ``link``'s rows, if it has one."""
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
        goal = GOALS.get(link)
        if goal is not None:
            out[workload]["goal"] = goal
            out[workload]["pass"] = ratios["hierarchical"]["median"] >= goal
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


# -- the compression suite (issue 45) --------------------------------------------------------------

C_WORKLOADS = {"W1": "MLP 784-1024-1024-10", "W2": "200 x Linear(64, 64), residual",
               "LM": "TransformerEncoder LM (2 layers, width 128, vocab 1024, 32 tokens)"}
C_UNISON = ("hier", "hier_bf16", "hier_fp16", "hier_psgd1", "hier_psgd4")
C_DDP = ("ddp", "ddp_bf16", "ddp_fp16", "ddp_psgd1", "ddp_psgd4")
C_VARIANTS = (*C_UNISON, *C_DDP)
C_PEER = dict(zip(C_UNISON, C_DDP))
C_LABELS = {"hier": "exact", "hier_bf16": "bf16", "hier_fp16": "fp16", "hier_psgd1": "PowerSGD r1",
            "hier_psgd4": "PowerSGD r4"}
C_GLOBAL_BATCH = {"W1": 256, "W2": 256, "LM": 64}
C_GOAL = 1.5
"""Compressed / exact hierarchical throughput goal at the slow links (100 and 250 Mbit/s)."""
C_GOAL_LINKS = ("100mbit", "250mbit")
C_EXACT_TOLERANCE = 1e-5
C_CLOSE_FACTOR = 2.0
"""A unison compression is as close as DDP's: its weights' largest distance to exact DDP's is at most this
times its DDP peer's (plus 1e-6)."""


def summarize_compression(run: dict[str, Any]) -> dict[str, Any]:
    """Per workload: samples/s, ratios to exact hierarchical and to the DDP peer, and the weight checks."""
    results = run["results"]
    out: dict[str, Any] = {}
    for workload, data in results[0]["train"].items():
        samples = data["samples"]
        batch = C_GLOBAL_BATCH[workload]
        rows = {}
        for name in C_VARIANTS:
            step = describe([t for r in samples[name] for t in r])
            rows[name] = {"median_step_ms": step["median"] * 1e3, "samples_per_s": batch / step["median"],
                          "steps_timed": step["n"]}

        def ratio(slow: str, fast: str, samples: dict = samples) -> float:  # per round: slow's median / fast's
            return statistics.median(statistics.median(a) / statistics.median(b)
                                     for a, b in zip(samples[slow], samples[fast]))

        digests = {name: {r["train"][workload]["digest"][name] for r in results} for name in C_VARIANTS}
        finite = {name: all(r["train"][workload]["finite"][name] for r in results) for name in C_VARIANTS}
        diff = {name: max(r["train"][workload]["weight_diff_vs_ddp"][name] for r in results) for name in C_VARIANTS}
        checks = {}
        for name in C_UNISON:
            peer = C_PEER[name]
            same = len(digests[name]) == 1 and len(digests[peer]) == 1
            if name == "hier":
                ok, rule = diff[name] <= C_EXACT_TOLERANCE, f"equal to DDP (<= {C_EXACT_TOLERANCE:g})"
            else:
                ok = diff[name] <= C_CLOSE_FACTOR * diff[peer] + 1e-6
                rule = f"as close to exact DDP as DDP's hook (<= {C_CLOSE_FACTOR:g} x)"
            checks[name] = {"ok": bool(ok and same and finite[name] and finite[peer]), "rule": rule,
                            "workers_equal": same, "finite": finite[name] and finite[peer],
                            "weight_diff_vs_ddp": diff[name], "peer_weight_diff_vs_ddp": diff[peer]}
        out[workload] = {
            "model": C_WORKLOADS[workload], "global_batch": batch, "gradient_mb": results[0]["train"][workload][
                "gradient_mb"], "variants": rows,
            "vs_exact_hierarchical": {name: ratio("hier", name) for name in C_UNISON if name != "hier"},
            "vs_ddp_peer": {name: ratio(C_PEER[name], name) for name in C_UNISON},
            "peer_vs_ddp": {peer: ratio("ddp", peer) for peer in C_DDP if peer != "ddp"},
            "checks": checks, "loss_batch0": results[0]["train"][workload]["loss_batch0"],
            "loss_batch0_at_start": results[0]["train"][workload]["loss_batch0_at_start"],
            "cores_busy": results[0]["train"][workload]["cores_busy"],
            "transports": results[0]["train"][workload]["transports"],
        }
    return out


def format_compression_table(summaries: dict[str, dict[str, Any]]) -> str:
    lines = [
        "2 simulated hosts x 2 workers; samples/s = global batch / median step time (worker 0);",
        "x exact: median over rounds of exact hierarchical's step time / the variant's (> 1: compression pays);",
        "x DDP peer: the same against DDP with its hook of the same kind (exact: DDP itself);",
        "weights: exact = equal to DDP's; compressed = every worker equal, finite, and no farther from exact DDP "
        f"than {C_CLOSE_FACTOR:g} x DDP's hook is",
        f"{'link':<8} {'work':<4} {'variant':<12} {'unison':>8} {'DDP peer':>9} {'x exact':>8} {'x DDP peer':>10} "
        f"{'|w-ddp| unison / peer':>22} {'weights':>8} {'goal':>10}",
    ]
    for link, summary in summaries.items():
        for workload, row in summary.items():
            v = row["variants"]
            for name in C_UNISON:
                peer, check = C_PEER[name], row["checks"][name]
                vs_exact = row["vs_exact_hierarchical"].get(name)
                goal = ""
                if vs_exact is not None and link in C_GOAL_LINKS:
                    goal = f">={C_GOAL:g} {'PASS' if vs_exact >= C_GOAL else 'FAIL'}"
                lines.append(
                    f"{link:<8} {workload:<4} {C_LABELS[name]:<12} {v[name]['samples_per_s']:>8.0f} "
                    f"{v[peer]['samples_per_s']:>9.0f} {'' if vs_exact is None else f'{vs_exact:.2f}':>8} "
                    f"{row['vs_ddp_peer'][name]:>10.2f} "
                    f"{check['weight_diff_vs_ddp']:>10.1e} / {check['peer_weight_diff_vs_ddp']:.1e} "
                    f"{'ok' if check['ok'] else 'BAD':>8} {goal:>10}")
    return "\n".join(lines)


def format_accuracy(acc: dict[str, Any]) -> str:
    accuracy = acc["accuracy"]
    exact = statistics.fmean(accuracy["hier"])
    lines = [f"digits (examples/digits.py data and CNN), {acc['test_digits']} held-out, {acc['steps']} steps of "
             f"global batch {acc['batch']}, seeds {acc['seeds']}, 2 hosts x 2 workers on the unlimited link:"]
    for name in C_UNISON:
        mean = statistics.fmean(accuracy[name])
        runs = ", ".join(f"{a:.4f}" for a in accuracy[name])
        gap = "" if name == "hier" else f"  gap to exact {100 * (mean - exact):+.2f} points"
        lines.append(f"  {C_LABELS[name]:<12} accuracy {mean:.4f} ({runs}){gap}")
    return "\n".join(lines)


def plot_compression(summaries: dict[str, dict[str, Any]], path: Path, machine: dict[str, Any]) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - the bench extra
        print("matplotlib is not installed (pip install unison[bench]): no chart written", file=sys.stderr)
        return False
    links = list(summaries)
    workloads = list(next(iter(summaries.values())))
    fig, axes = plt.subplots(len(workloads), len(links), figsize=(4.6 * len(links), 3.6 * len(workloads)),
                             squeeze=False)
    xs = range(len(C_UNISON))
    for i, workload in enumerate(workloads):
        for j, link in enumerate(links):
            ax, row = axes[i][j], summaries[link][workload]
            mine = [row["variants"][n]["samples_per_s"] for n in C_UNISON]
            peers = [row["variants"][C_PEER[n]]["samples_per_s"] for n in C_UNISON]
            ax.bar([x - 0.2 for x in xs], mine, 0.4, color="#4477aa", label="unison hierarchical")
            ax.bar([x + 0.2 for x in xs], peers, 0.4, color="#ee7733", label="DDP (its hooks)")
            for x, value in zip(xs, mine):
                ax.annotate(f"{value / mine[0]:.2f}x", (x - 0.2, value), ha="center", va="bottom", fontsize=7)
            ax.set_xticks(list(xs), [C_LABELS[n] for n in C_UNISON], fontsize=7)
            ax.set_title(f"{workload} ({row['gradient_mb']:.1f} MB of gradients), link {link}", fontsize=9)
            ax.set_ylabel("samples/s")
            if i == 0 and j == 0:
                ax.legend(fontsize=7)
    fig.suptitle(f"gradient compression across 2 simulated hosts x 2 workers (labels: x exact hierarchical) -- "
                 f"{machine['cpu_model']}, {machine['usable_cores']} cores, {machine['date'][:10]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main_compression(args: argparse.Namespace, argv: list[str] | None) -> int:
    links = [link.strip() for link in args.links.split(",") if link.strip()]
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if args.quick:
        args.rounds, args.steps, args.warmup, args.accuracy_epochs = 1, 2, 3, 2
        args.accuracy_seeds = "0"
    bad = [w for w in workloads if w not in C_WORKLOADS]
    if bad or not workloads:
        raise SystemExit(f"--workloads: unknown {bad or args.workloads!r}; choose from {', '.join(C_WORKLOADS)}")
    seeds = [int(x) for x in args.accuracy_seeds.split(",") if x.strip()]
    cfg = {"suite": "compression", "workloads": workloads, "rounds": args.rounds, "steps": args.steps,
           "warmup": args.warmup, "num_batches": 4, "timeout": 300.0}
    acc_cfg = {"suite": "compression", "workloads": [], "accuracy": True, "accuracy_epochs": args.accuracy_epochs,
               "accuracy_batch": 64, "accuracy_seeds": seeds, "timeout": 300.0}
    machine = machine_info()
    start = time.perf_counter()
    summaries, raw, timings = {}, {}, {}
    for link in links:
        print(f"link {link}: launching 2 hosts x 2 workers ({', '.join(workloads)}, 10 variants) ...", flush=True)
        began = time.perf_counter()
        run = run_link(link, cfg, timeout=900.0)
        timings[link] = time.perf_counter() - began
        raw[link] = {w: run["results"][0]["train"][w]["samples"] for w in workloads}
        summaries[link] = summarize_compression(run)
        print(f"  ({timings[link]:.0f} s)", flush=True)
    accuracy = None
    if seeds and args.accuracy_epochs > 0:
        print("accuracy: digits on the unlimited link, exact and each compression ...", flush=True)
        began = time.perf_counter()
        run = run_link("none", acc_cfg, timeout=900.0)
        timings["accuracy"] = time.perf_counter() - began
        accuracy = {**run["results"][0]["accuracy"], "batch": acc_cfg["accuracy_batch"], "seeds": seeds,
                    "workers_agree": all(r["accuracy"]["accuracy"] == run["results"][0]["accuracy"]["accuracy"]
                                         for r in run["results"])}
    elapsed = time.perf_counter() - start
    if summaries:
        print(format_compression_table(summaries))
        transports = {t for s in summaries.values() for row in s.values() for t in row["transports"].values()}
        print(f"unison's transports: {', '.join(sorted(transports))}")
    if accuracy is not None:
        print(format_accuracy(accuracy))
    print(f"({elapsed:.0f} s in all: {', '.join(f'{k} {v:.0f} s' for k, v in timings.items())}; "
          f"{machine['cpu_model']}, {machine['usable_cores']} usable cores, load average before "
          f"{machine['load_average_1_5_15']}, torch {machine['torch']})")
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"benchmark": "multi_host_compression", "command": "python benchmarks/multi_host.py " + " ".join(
        sys.argv[1:] if argv is None else argv), "config": {**cfg, "links": links, "hosts": 2,
        "workers_per_host": 2, "threads_per_process": 1, "accuracy": acc_cfg}, "summary": summaries,
        "accuracy": accuracy, "samples_worker0_s": raw, "elapsed_s": elapsed, "seconds_per_part": timings,
        "machine": machine}  # fmt: skip
    json_path = args.out / "multi_host_compression.json"
    json_path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {json_path}")
    png_path = args.out / "multi_host_compression.png"
    if summaries and plot_compression(summaries, png_path, machine):
        print(f"wrote {png_path}")
    correct = all(c["ok"] for s in summaries.values() for row in s.values() for c in row["checks"].values())
    correct = correct and (accuracy is None or (accuracy["finite"] and accuracy["workers_agree"]))
    return 0 if correct else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", choices=["transports", "compression"], default="transports",
                        help="transports (issue 15, the default) or compression (issue 45: bf16 / fp16 / PowerSGD "
                             "beside DDP's hooks; its own defaults below)")
    parser.add_argument("--accuracy-epochs", type=int, default=6,
                        help="compression suite: digits epochs per accuracy run (0: no accuracy part; default 6)")
    parser.add_argument("--accuracy-seeds", default="0,1", help="compression suite: digits seeds (default 0,1)")
    parser.add_argument("--links", default="none,1gbit,250mbit",
                        help="comma-separated link settings, 'none' or a tc rate such as 1gbit "
                             "(default none,1gbit,250mbit)")
    parser.add_argument("--workloads", default="W1,W2", help="comma-separated, of W1, W2 (default both)")
    parser.add_argument("--rounds", type=int, default=8, help="interleaved rounds (default 8)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant per round (default 5)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first (default 3)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke mode: 2 rounds of 2 steps, W2 only, no link limit (compression suite: 1 round of "
                             "2 steps, every workload, 250mbit unless --links, 2 digits epochs of one seed)")
    parser.add_argument("--out", type=Path, default=HERE / "out", help="output folder (default benchmarks/out)")
    args = parser.parse_args(argv)
    reason = unavailable_reason()
    if reason is not None:
        print(f"multi_host.py needs simulated hosts, which this machine cannot make: {reason}", file=sys.stderr)
        return 2
    if args.suite == "compression":
        given = set(sys.argv[1:] if argv is None else argv)
        if "--links" not in given:
            args.links = "250mbit" if args.quick else "100mbit,250mbit,1gbit"
        if "--workloads" not in given:
            args.workloads = "W1,W2,LM"
        if "--rounds" not in given:
            args.rounds = 4
        return main_compression(args, argv)
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
        summaries[link] = summarize(run, link)
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
