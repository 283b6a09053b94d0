"""Fast-path benchmark: one training step under a one-device strategy vs plain PyTorch.

Design principle 4 says a worker with one device runs its replica inline, so a step
under ``OneDeviceStrategy`` or a one-device ``MirroredStrategy`` must cost no more than
plain PyTorch (target: at most 5% more per step). This script measures that in one
process and one run:

- ``plain``: a 784-256-10 MLP, SGD, ``zero_grad(); loss.backward(); opt.step()``;
- ``one_device``: the same model and optimizer built in ``OneDeviceStrategy("cpu:0").scope()``,
  the step called through ``strategy.run``;
- ``mirrored_1``: the same under ``MirroredStrategy(["cpu:0"])``.

Every variant is warmed up, then the variants are timed in interleaved rounds (the
order rotates each round) so that clock drift, turbo and cache effects hit all of
them alike; the median per-step time of each is reported with its ratio to plain,
along with the ratio of the minima and the median of per-round (paired) ratios, which
are steadier on a machine shared with other work. All variants run in one process, so
plain PyTorch also pays unison's process-wide optimizer hooks (an attribute lookup,
well under 1 us per step).
Writes ``<out>/fast_path.json`` (numbers + machine info) and ``<out>/fast_path.png``.
The exit code is always 0: the ratios are read, not asserted (a benchmark is not a test).

Usage:
    python benchmarks/fast_path.py [--steps N] [--rounds R] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _common import machine_info
from torch import nn

import unison

IN_FEATURES, HIDDEN, CLASSES, BATCH = 784, 256, 10, 64


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN_FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))


def _train_step(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    loss_fn = nn.functional.cross_entropy

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return step


def make_plain() -> Callable[[torch.Tensor, torch.Tensor], Any]:
    model = _mlp()
    return _train_step(model, torch.optim.SGD(model.parameters(), lr=0.01))


def make_strategy(strategy: unison.Strategy) -> Callable[[torch.Tensor, torch.Tensor], Any]:
    with strategy.scope():
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
    step = _train_step(model, opt)
    run = strategy.run

    def strategy_step(x: torch.Tensor, y: torch.Tensor) -> Any:
        return run(step, args=(x, y))

    return strategy_step


VARIANTS: dict[str, Callable[[], Callable[[torch.Tensor, torch.Tensor], Any]]] = {
    "plain": make_plain,
    "one_device": lambda: make_strategy(unison.OneDeviceStrategy("cpu:0")),
    "mirrored_1": lambda: make_strategy(unison.MirroredStrategy(["cpu:0"])),
}


def _time_steps(step: Callable[[torch.Tensor, torch.Tensor], Any], batches: list, steps: int) -> float:
    """Seconds per step over ``steps`` steps (cycling through ``batches``)."""
    n = len(batches)
    start = time.perf_counter()
    for i in range(steps):
        x, y = batches[i % n]
        step(x, y)
    return (time.perf_counter() - start) / steps


def measure(steps: int, rounds: int, warmup: int) -> dict[str, list[float]]:
    """Per-step seconds of every variant, one sample per round, rounds interleaved."""
    gen = torch.Generator().manual_seed(0)
    batches = [
        (torch.randn(BATCH, IN_FEATURES, generator=gen), torch.randint(0, CLASSES, (BATCH,), generator=gen))
        for _ in range(16)
    ]
    steps_fns = {name: make() for name, make in VARIANTS.items()}
    for step in steps_fns.values():
        _time_steps(step, batches, warmup)
    names = list(steps_fns)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]  # rotate to cancel order effects
        for name in order:
            samples[name].append(_time_steps(steps_fns[name], batches, steps))
    return samples


def summarize(samples: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Median/min/max per variant; ratios to plain of the medians, of the minima, and the
    median of per-round ratios (each round's samples are seconds apart, so load from other
    processes on a shared machine hits both sides of a paired ratio alike)."""
    plain = samples["plain"]
    out = {}
    for name, values in samples.items():
        median = statistics.median(values)
        out[name] = {
            "median_step_us": median * 1e6,
            "min_step_us": min(values) * 1e6,
            "max_step_us": max(values) * 1e6,
            "ratio_vs_plain": median / statistics.median(plain),
            "ratio_of_min_vs_plain": min(values) / min(plain),
            "paired_ratio_median": statistics.median(v / p for v, p in zip(values, plain)),
        }
    return out


def print_table(summary: dict[str, dict[str, float]]) -> None:
    print(f"{'variant':<12} {'median us/step':>15} {'min':>9} {'max':>9} {'x plain':>8} {'x (min)':>8} "
          f"{'x (paired)':>10}")
    for name, row in summary.items():
        print(
            f"{name:<12} {row['median_step_us']:>15.1f} {row['min_step_us']:>9.1f} {row['max_step_us']:>9.1f} "
            f"{row['ratio_vs_plain']:>8.3f} {row['ratio_of_min_vs_plain']:>8.3f} {row['paired_ratio_median']:>10.3f}"
        )


def plot(summary: dict[str, dict[str, float]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - matplotlib is the `bench` extra
        print("matplotlib is not installed (pip install unison[bench]): no chart written", file=sys.stderr)
        return False
    names = list(summary)
    medians = [summary[n]["median_step_us"] for n in names]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    bars = ax.bar(names, medians, color=["#888888", "#4477aa", "#66ccee"][: len(names)])
    for bar, name in zip(bars, names):
        row = summary[name]
        ax.annotate(f"{row['median_step_us']:.0f} us\n{row['ratio_vs_plain']:.3f}x",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height() / 2),
                    ha="center", va="center", fontsize=9, color="white")
    ax.axhline(medians[0] * 1.05, color="#cc3311", linestyle="--", linewidth=1, label="plain + 5%")
    ax.set_ylim(0, max(max(medians), medians[0] * 1.05) * 1.12)
    ax.set_ylabel("median time per step (us)")
    ax.set_title(f"Training step, MLP {IN_FEATURES}-{HIDDEN}-{CLASSES}, batch {BATCH}, SGD, 1 thread")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100, help="timed steps per variant per round (default 100)")
    parser.add_argument("--rounds", type=int, default=40, help="interleaved rounds (default 40)")
    parser.add_argument("--warmup", type=int, default=50, help="untimed steps per variant first (default 50)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out",
                        help="output folder (default benchmarks/out)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # stable timing; a thread pool adds more noise than the overhead measured

    samples = measure(args.steps, args.rounds, args.warmup)
    summary = summarize(samples)
    print_table(summary)

    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "benchmark": "fast_path",
        "model": f"MLP {IN_FEATURES}-{HIDDEN}-{CLASSES}",
        "batch_size": BATCH,
        "optimizer": "SGD(lr=0.01)",
        "steps_per_round": args.steps,
        "rounds": args.rounds,
        "warmup_steps": args.warmup,
        "target_ratio": 1.05,
        "summary": summary,
        "samples_step_us": {name: [v * 1e6 for v in values] for name, values in samples.items()},
        "machine": {**machine_info(), "torch_threads": torch.get_num_threads()},
    }
    json_path = args.out / "fast_path.json"
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {json_path}")
    png_path = args.out / "fast_path.png"
    if plot(summary, png_path):
        print(f"wrote {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
