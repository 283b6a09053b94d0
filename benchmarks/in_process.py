"""In-process strategies against plain PyTorch on three workloads, in one process and one run.

The rows of the performance issue's table that run in one process:

- ``W1``: MLP 784-1024-1024-10, batch 256 (few large matrix products);
- ``W2``: 200 x Linear(64, 64), batch 256 (400 small parameters: per-op overhead);
- ``D``: one Linear(10, 10), batch 8 (a tiny step: per-step overhead).

Variants, each with plain ``zero_grad(); loss.backward(); opt.step()`` and SGD:

- ``plain``: plain PyTorch with the process's intra-op threads (2 on this machine);
- ``one_device``: the model built in ``OneDeviceStrategy("cpu:0").scope()``, the step
  through ``strategy.run``;
- ``mirrored``: ``MirroredStrategy(["cpu:0", "cpu:1"])``, each replica on half the batch;
- ``threads_floor`` (a reference, not unison): two plain-PyTorch models, each trained on
  half the batch in a thread of its own with half the intra-op threads, handed the step
  through a queue and waited for, as Mirrored's replicas are -- with no reduction, so
  their weights part. The least a replica-per-thread design can cost on this machine:
  Mirrored's goals above this ratio are out of reach of any such design here.
- ``threads_reduce_floor`` (a reference, not unison): the same two threads, meeting once a
  step after backward, where the last to arrive averages the two models' gradients (one
  in-place sum and copy per parameter) and wakes the other, as Mirrored's merge does; their
  weights stay equal. The least a replica-per-thread design that reduces can cost: the
  floor above plus one rendezvous and the reduction's own arithmetic.

Variants are timed in interleaved rounds (the order rotates each round); the reported
ratio is the median over rounds of plain's step time divided by the variant's (samples
per second relative to plain: above 1 is faster). After timing, each variant trains
the workload for a few float64 steps from the same initial weights and batches, and
the largest weight difference to plain PyTorch is reported (Mirrored's gradients are
the mean over two half batches: equal to plain up to round-off).

Writes ``<out>/in_process.json`` and ``<out>/in_process.png``; the exit code is 0
whatever the ratios (a benchmark is read, not asserted).

Usage:
    python benchmarks/in_process.py [--rounds 12] [--workloads W1,W2,D] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _common import machine_info, max_weight_diffs, mse_sgd_step, rotating_rounds
from torch import nn

import unison

WORKLOADS: dict[str, dict[str, Any]] = {
    "W1": {"make": lambda: nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                                         nn.Linear(1024, 10)),
           "batch": 256, "inputs": 784, "outputs": 10, "steps": 6},
    "W2": {"make": lambda: nn.Sequential(*[nn.Linear(64, 64) for _ in range(200)]),
           "batch": 256, "inputs": 64, "outputs": 64, "steps": 8},
    "D": {"make": lambda: nn.Linear(10, 10), "batch": 8, "inputs": 10, "outputs": 10, "steps": 200},
}
VARIANTS = ("plain", "one_device", "mirrored", "threads_floor", "threads_reduce_floor")
STRATEGY_VARIANTS = ("plain", "one_device", "mirrored", "threads_reduce_floor")
"""The variants whose weights must equal plain PyTorch's (``threads_floor`` does not reduce)."""


def _batches(spec: dict[str, Any], dtype: torch.dtype = torch.float32, count: int = 4) -> list:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(spec["batch"], spec["inputs"], generator=g, dtype=dtype),
             torch.randn(spec["batch"], spec["outputs"], generator=g, dtype=dtype)) for _ in range(count)]


def _model(spec: dict[str, Any], dtype: torch.dtype) -> nn.Module:
    # Built in the dtype (the default dtype while the module is made): every variant gets
    # the same weights, drawn in that dtype.
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return spec["make"]()
    finally:
        torch.set_default_dtype(previous)


class ThreadsFloor:
    """Two plain models, each trained on half the batch in its own thread (the reference floor).

    Replica 0's model steps in the caller's thread and replica 1's in a thread that waits
    on a queue, each with ``threads // 2`` intra-op threads (replica 0 only for the step),
    exactly the thread layout of unison's CPU replicas -- minus everything that makes
    them one model: no variables, no gradient reduction, no merge.
    """

    def __init__(self, spec: dict[str, Any], dtype: torch.dtype, reduce: bool = False):
        self._models = [_model(spec, dtype) for _ in range(2)]
        self._opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in self._models]
        # ``reduce``: a rendezvous after backward whose last arrival averages the gradients
        self._meet = threading.Barrier(2, action=self._average) if reduce else None
        self._requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[Any] = queue.SimpleQueue()
        own = torch.get_num_threads()
        self._share = max(1, own // 2)
        ready = threading.Event()
        threading.Thread(target=self._serve, args=(ready,), name="threads-floor", daemon=True).start()
        ready.wait(10)
        torch.set_num_threads(own)  # set_num_threads in the thread also set the default of later threads

    def _serve(self, ready: threading.Event) -> None:
        torch.get_num_threads()
        torch.set_num_threads(self._share)
        ready.set()
        while True:
            x, y = self._requests.get()
            try:
                self._train(1, x, y)
            finally:
                self._done.put(None)

    def _train(self, i: int, x: torch.Tensor, y: torch.Tensor) -> None:
        model, opt = self._models[i], self._opts[i]
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if self._meet is not None:
            self._meet.wait(30)
        opt.step()

    def _average(self) -> None:
        with torch.no_grad():
            for first, second in zip(self._models[0].parameters(), self._models[1].parameters()):
                first.grad.add_(second.grad).mul_(0.5)
                second.grad.copy_(first.grad)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        xs, ys = x.chunk(2), y.chunk(2)
        self._requests.put((xs[1], ys[1]))
        own = torch.get_num_threads()
        torch.set_num_threads(self._share)
        try:
            self._train(0, xs[0], ys[0])
        finally:
            torch.set_num_threads(own)
            self._done.get()


def make_step(variant: str, spec: dict[str, Any], dtype: torch.dtype = torch.float32) -> tuple[Callable, nn.Module]:
    """A function ``step(x, y)`` training one batch under ``variant``, and its model."""
    if variant in ("threads_floor", "threads_reduce_floor"):
        floor = ThreadsFloor(spec, dtype, reduce=variant == "threads_reduce_floor")
        return floor, floor._models[0]
    strategy: unison.Strategy | None = None
    if variant == "one_device":
        strategy = unison.OneDeviceStrategy("cpu:0")
    elif variant == "mirrored":
        strategy = unison.MirroredStrategy(["cpu:0", "cpu:1"])
    if strategy is None:
        model = _model(spec, dtype)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
    else:
        with strategy.scope():
            model = _model(spec, dtype)
            opt = torch.optim.SGD(model.parameters(), lr=0.01)

    train = mse_sgd_step(model, opt)
    if strategy is None:
        return train, model
    if variant == "one_device":
        run = strategy.run
        return (lambda x, y: run(train, args=(x, y))), model
    mirrored = strategy

    def halves(x: torch.Tensor, y: torch.Tensor) -> Any:
        xs, ys = x.chunk(2), y.chunk(2)
        return unison.PerReplica([(xs[0], ys[0]), (xs[1], ys[1])])

    def mirrored_step(x: torch.Tensor, y: torch.Tensor) -> None:
        mirrored.run(lambda batch: train(*batch), args=(halves(x, y),))

    return mirrored_step, model


def _time(step: Callable, batches: list, steps: int) -> float:
    start = time.perf_counter()
    for i in range(steps):
        step(*batches[i % len(batches)])
    return (time.perf_counter() - start) / steps


def measure(name: str, rounds: int) -> dict[str, Any]:
    spec = WORKLOADS[name]
    batches = _batches(spec)
    steps = {variant: make_step(variant, spec)[0] for variant in VARIANTS}
    for step in steps.values():
        _time(step, batches, max(2, spec["steps"] // 2))  # warm-up
    samples = rotating_rounds(VARIANTS, lambda variant: _time(steps[variant], batches, spec["steps"]), rounds)
    plain = samples["plain"]
    summary = {
        variant: {
            "median_step_ms": statistics.median(values) * 1e3,
            "samples_per_s_vs_plain": statistics.median(p / v for p, v in zip(plain, values)),
        }
        for variant, values in samples.items()
    }
    return {"summary": summary, "samples_step_s": samples, "max_weight_diff_vs_plain": weight_diffs(spec)}


def weight_diffs(spec: dict[str, Any], steps: int = 5) -> dict[str, float]:
    """Largest |weight - plain weight| after a few float64 steps from the same start."""
    return max_weight_diffs(lambda variant: make_step(variant, spec, torch.float64), STRATEGY_VARIANTS,
                            _batches(spec, torch.float64), steps)


def plot(results: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - matplotlib is the `bench` extra
        print("matplotlib is not installed (pip install unison[bench]): no chart written", file=sys.stderr)
        return False
    names = list(results)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.2
    for k, variant in enumerate(("one_device", "mirrored", "threads_floor", "threads_reduce_floor")):
        ratios = [results[n]["summary"][variant]["samples_per_s_vs_plain"] for n in names]
        floor = variant.startswith("threads")
        bars = ax.bar([i + (k - 1.5) * width for i in range(len(names))], ratios, width, label=variant,
                      hatch="//" if floor else None, alpha=0.6 if floor else 1.0)
        for bar, ratio in zip(bars, ratios):
            ax.annotate(f"{ratio:.2f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=8)
    ax.axhline(1.0, color="#888888", linestyle="--", linewidth=1, label="plain PyTorch")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("samples/s relative to plain")
    ax.set_title("In-process strategies vs plain PyTorch (median of paired rounds)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=12, help="interleaved rounds per workload (default 12)")
    parser.add_argument("--workloads", default="W1,W2,D", help="comma-separated subset of W1,W2,D")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out",
                        help="output folder (default benchmarks/out)")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        parser.error(f"--workloads: unknown {unknown!r}; choose from {list(WORKLOADS)!r}")
    results = {}
    print(f"{'workload':<13} {'variant':<21} {'ms/step':>9} {'x plain (samples/s)':>20} {'max |w - plain|':>16}")
    for name in names:
        results[name] = measure(name, args.rounds)
        for variant, row in results[name]["summary"].items():
            diff = results[name]["max_weight_diff_vs_plain"].get(variant)
            shown = f"{diff:>16.2e}" if diff is not None else f"{'(no reduction)':>16}"
            print(f"{name:<13} {variant:<21} {row['median_step_ms']:>9.2f} {row['samples_per_s_vs_plain']:>20.3f} "
                  f"{shown}", flush=True)
    for name, result in results.items():  # Mirrored against each floor (samples/s, median of the paired ratios)
        summary = result["summary"]
        mirrored = summary["mirrored"]["samples_per_s_vs_plain"]
        floors = {floor: mirrored / summary[floor]["samples_per_s_vs_plain"]
                  for floor in ("threads_floor", "threads_reduce_floor")}
        result["mirrored_vs_floors"] = floors
        print(f"{name}: mirrored / threads_floor {floors['threads_floor']:.3f}, mirrored / threads_reduce_floor "
              f"{floors['threads_reduce_floor']:.3f}")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "in_process.json"
    path.write_text(json.dumps({"benchmark": "in_process", "rounds": args.rounds, "results": results,
                                "machine": {**machine_info(), "torch_threads": torch.get_num_threads()}},
                               indent=2) + "\n")
    print(f"wrote {path}")
    if plot(results, args.out / "in_process.png"):
        print(f"wrote {args.out / 'in_process.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
