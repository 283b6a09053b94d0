"""OneDeviceStrategy against plain PyTorch, each variant in a process of its own, as a user runs them.

``fast_path.py`` times the variants in one process, where plain PyTorch also pays unison's
process-wide optimizer hook once a strategy installed it; a user's plain program never
imports unison. Here every sample is a fresh interpreter running one variant for a fixed
number of steps (``--threads`` intra-op threads, 2 by default as on this machine), and the
rounds alternate the variants' order. Reported per workload: the median per-step time of
each variant and the median of the per-round ratios plain/one_device (>= 0.97 is the goal:
issues 42 and 45). ``run_floor`` is the reference: the plain step called as
``run(step, args=(x, y))`` through a function that only pushes an entry on a thread-local
stack around ``fn(*args)``, the least ``strategy.run``'s API and its replica context cost.

Workloads are ``multi_worker.py``'s: W1 (MLP 784-1024-1024-10, batch 256), W2 (200 x
Linear(64, 64) residual, batch 256), D (Linear(10, 10), batch 8), SGD(lr=0.01).

    python benchmarks/one_device.py [--workloads D,W1,W2] [--rounds 6] [--out DIR]

With ``--tree PATH`` the one_device variant imports unison from ``PATH/src`` (an old tree made
by ``git worktree add``): old and new then pair in one run as ``one_device@old``.
The exit code is always 0: the ratios are read, not asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

STEPS = {"W1": 60, "W2": 60, "D": 4000}
WARMUP = {"W1": 10, "W2": 10, "D": 400}

_CHILD = r'''
import sys, time, torch
from torch import nn
variant, workload = sys.argv[1], sys.argv[2]
steps, warmup, threads = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
torch.set_num_threads(threads)
torch.manual_seed(0)

class LinearStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(200))
    def forward(self, x):
        for layer in self.layers:
            x = x + 0.1 * torch.tanh(layer(x))
        return x

def model_and_batches():
    gen = torch.Generator().manual_seed(1234)
    if workload == "W1":
        model = nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
        return model, [(torch.randn(256, 784, generator=gen), torch.randint(0, 10, (256,), generator=gen))
                       for _ in range(8)], nn.functional.cross_entropy
    model = nn.Linear(10, 10) if workload == "D" else LinearStack()
    batch, width = (8, 10) if workload == "D" else (256, 64)
    return model, [(torch.randn(batch, width, generator=gen), torch.randn(batch, width, generator=gen))
                   for _ in range(8)], nn.functional.mse_loss

if variant in ("plain", "run_floor"):
    model, batches, loss_fn = model_and_batches()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    def step(x, y):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    call = step
    if variant == "run_floor":
        # The least a `run(fn, args=...)` with a per-thread context can do, without unison: the
        # call passes through a function that pushes an entry on a thread-local stack and
        # calls fn(*args). plain/run_floor is the ceiling of any such API on this machine.
        import threading
        class PerThread(threading.local):
            def __init__(self):
                self.stack = []
        per_thread, entry = PerThread(), object()
        def run(fn, args=(), kwargs=None):
            stack = per_thread.stack
            stack.append(entry)
            try:
                return fn(*args)
            finally:
                stack.pop()
        def call(x, y):
            run(step, args=(x, y))
else:
    import unison
    strategy = unison.OneDeviceStrategy("cpu:0")
    with strategy.scope():
        model, batches, loss_fn = model_and_batches()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
    def step(x, y):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    run = strategy.run
    def call(x, y):
        run(step, args=(x, y))
n = len(batches)
for i in range(warmup):
    call(*batches[i % n])
start = time.perf_counter()
for i in range(steps):
    call(*batches[i % n])
print((time.perf_counter() - start) / steps)
'''


def _sample(variant: str, workload: str, threads: int, tree: Path | None) -> float:
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = str(tree.resolve() / "src")
    done = subprocess.run([sys.executable, "-c", _CHILD, variant.split("@")[0], workload, str(STEPS[workload]),
                           str(WARMUP[workload]), str(threads)], env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    if done.returncode:
        sys.exit(f"{variant} on {workload} failed:\n{done.stderr[-3000:]}")
    return float(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="D,W1,W2")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tree", type=Path, default=None, help="an old tree: adds the variant one_device@old")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    variants = ["plain", "one_device", "run_floor"] + (["one_device@old"] if args.tree is not None else [])
    report: dict[str, dict] = {}
    load_before = os.getloadavg()
    for workload in args.workloads.split(","):
        samples: dict[str, list[float]] = {v: [] for v in variants}
        for r in range(args.rounds):
            order = variants[r % len(variants):] + variants[:r % len(variants)]
            for variant in order:
                tree = args.tree if variant.endswith("@old") else None
                samples[variant].append(_sample(variant, workload, args.threads, tree))
        ratios = {v: statistics.median(p / s for p, s in zip(samples["plain"], samples[v], strict=True))
                  for v in variants[1:]}
        # how close unison's run comes to the least any run(fn, args) costs (1.0: at that floor)
        against_floor = {v: statistics.median(f / s for f, s in zip(samples["run_floor"], samples[v], strict=True))
                         for v in variants if v.startswith("one_device")}
        report[workload] = {"median_us": {v: statistics.median(s) * 1e6 for v, s in samples.items()},
                            "plain_over": ratios, "run_floor_over": against_floor, "samples_s": samples}
        cells = "  ".join(f"{v} {statistics.median(s) * 1e6:9.1f} us" for v, s in samples.items())
        print(f"{workload:3s} {cells}  " + "  ".join(f"plain/{v} {x:.3f}" for v, x in ratios.items())
              + "  " + "  ".join(f"run_floor/{v} {x:.3f}" for v, x in against_floor.items()), flush=True)
    load_after = os.getloadavg()
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "one_device.json").write_text(json.dumps(
        {"results": report, "threads": args.threads, "rounds": args.rounds, "load_before": load_before,
         "load_after": load_after, "time": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
