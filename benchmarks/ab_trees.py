"""Old tree against new tree in one run: each tree's own benchmark script, alternating by round.

An architecture change must leave nothing slower; on a VM whose speed drifts for minutes at a
time, only pairs measured minutes apart say so. Each round runs the benchmark on both trees
(``git worktree add /tmp/old <commit>`` makes the old one), old first in even rounds and new
first in odd ones, with ``PYTHONPATH`` at each tree's ``src`` so launched processes import that
tree too. Prints each run's samples/s and load average, then the per-round ratios new/old.

    python benchmarks/ab_trees.py OLD_TREE NEW_TREE BENCHMARK [--rounds 4]

BENCHMARK is ``recsys`` or ``parameter_server`` (samples/s), or one of the hot-path ones,
``multi_worker`` (unison/DDP and the time above the no-sync floor), ``in_process`` (each
variant's samples/s against plain) or ``fast_path`` (one device against plain): those compare
each tree's ratio against its own in-run peer, so a slower machine minute cancels out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _command(which: str, out: Path) -> list[str]:
    if which == "multi_worker":
        return [sys.executable, "benchmarks/multi_worker.py", "--rounds", "8", "--ar-rounds", "2", "--out", str(out)]
    if which == "in_process":
        return [sys.executable, "benchmarks/in_process.py", "--rounds", "6", "--out", str(out)]
    if which == "fast_path":
        return [sys.executable, "benchmarks/fast_path.py", "--rounds", "16", "--out", str(out)]
    if which == "recsys":
        return [sys.executable, "benchmarks/recsys.py", "--variants", "unison_hybrid,unison_ps", "--rounds", "1",
                "--samples", "100000", "--eval-samples", "20000", "--out", str(out)]
    return [sys.executable, "benchmarks/parameter_server.py", "--steps", "40", "--warmup", "8", "--skip-mwms",
            "--out", str(out)]


def _samples_per_s(which: str, out: Path) -> dict[str, float]:
    """The numbers compared: samples/s, or for the hot-path benchmarks each tree's in-run ratios."""
    if which == "multi_worker":
        train = json.loads((out / "multi_worker.json").read_text())["summary"]["train"]
        return {**{f"{w}/unison_vs_ddp": t["unison_vs_ddp"] for w, t in train.items()},
                **{f"{w}/above_floor_share": t["unison_above_floor"] for w, t in train.items()}}
    if which == "in_process":
        results = json.loads((out / "in_process.json").read_text())["results"]
        return {f"{w}/{v}_vs_plain": row["samples_per_s_vs_plain"] for w, r in results.items()
                for v, row in r["summary"].items() if v != "plain"}
    if which == "fast_path":
        summary = json.loads((out / "fast_path.json").read_text())["summary"]
        return {f"{v}_paired_step_ratio": row["paired_ratio_median"] for v, row in summary.items() if v != "plain"}
    if which == "recsys":
        results = json.loads((out / "recsys.json").read_text())["rounds"][0]["results"]
        return {name: r["samples_per_s"] for name, r in results.items() if "samples_per_s" in r}
    results = json.loads((out / "parameter_server.json").read_text())["results"]
    return {f"{workload}/{name}": r["samples_per_s"] for workload, runs in results.items()
            for name, r in runs.items() if r and "samples_per_s" in r}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("benchmark", choices=("recsys", "parameter_server", "multi_worker", "in_process", "fast_path"))
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    with tempfile.TemporaryDirectory() as scratch:
        for index in range(args.rounds):
            order = [("old", args.old), ("new", args.new)]
            for name, tree in order if index % 2 == 0 else reversed(order):
                out = Path(scratch) / f"{name}_{index}"
                load, start = os.getloadavg()[0], time.time()
                env = dict(os.environ, PYTHONPATH=str(tree.resolve() / "src"))
                done = subprocess.run(_command(args.benchmark, out), cwd=tree, env=env, capture_output=True, text=True,
                                      timeout=1800)
                if done.returncode:
                    sys.exit(f"{name} tree, round {index}: the benchmark failed:\n{done.stderr[-3000:]}")
                runs[name].append(_samples_per_s(args.benchmark, out))
                shown = {k: round(v, 3) if v < 100 else round(v) for k, v in runs[name][-1].items()}
                print(f"round {index} {name} (load {load:.2f}, {time.time() - start:.0f} s): {shown}", flush=True)
    for variant in runs["new"][0]:
        if variant not in runs["old"][0]:  # a variant the old tree's benchmark does not have
            print(f"{variant}: new tree only, per round {[round(new[variant], 3) for new in runs['new']]}")
            continue
        ratios = [new[variant] / old[variant] for old, new in zip(runs["old"], runs["new"], strict=True)]
        print(f"{variant}: new/old per round {[round(r, 3) for r in ratios]}, median {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
