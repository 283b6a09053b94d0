"""Small helpers shared by the benchmark scripts: machine description and summary statistics."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch

import unison


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo (Linux), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    """What a result depends on: platform, CPU, core count, versions, load and the date."""
    try:
        load = list(os.getloadavg())
    except OSError:  # pragma: no cover - not on every platform
        load = None
    try:
        usable_cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not on every platform
        usable_cores = os.cpu_count()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "usable_cores": usable_cores,
        "load_average_1_5_15": load,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "unison": unison.__version__,
    }


def describe(values: Sequence[float]) -> dict[str, float]:
    """Median, mean, min, max and count of a sample."""
    return {
        "median": statistics.median(values),
        "mean": statistics.fmean(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def interleaved_rounds(steps: dict, batches: list, cfg: dict[str, Any]) -> tuple[dict[str, list[list[float]]], dict]:
    """Times training step functions in interleaved rounds, in every worker process alike.

    ``steps[name](x, y)`` trains one step; each variant walks ``batches`` in order from
    its own position, so all take the same steps on the same data. After
    ``cfg["warmup"]`` untimed steps each, ``cfg["rounds"]`` rounds time ``cfg["steps"]``
    steps of every variant, the order rotating every round and reversed every other
    one, so drift and outside load hit every variant alike. A barrier of the default
    process group precedes each block, so the workers time the same variant together.

    Returns:
        Per variant, the step times of every round; and how many steps each took.
    """
    import time

    import torch.distributed as dist

    names = tuple(steps)
    taken = dict.fromkeys(names, 0)

    def run(name: str, n: int) -> list[float]:
        dist.barrier()
        times = []
        for _ in range(n):
            x, y = batches[taken[name] % len(batches)]
            taken[name] += 1
            start = time.perf_counter()
            steps[name](x, y)
            times.append(time.perf_counter() - start)
        return times

    for name in names:
        run(name, cfg["warmup"])
    samples: dict[str, list[list[float]]] = {name: [] for name in names}
    for r in range(cfg["rounds"]):
        order = names[r % len(names):] + names[:r % len(names)]
        if r % 2:
            order = tuple(reversed(order))
        for name in order:
            samples[name].append(run(name, cfg["steps"]))
    dist.barrier()
    return samples, taken


def mse_sgd_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> Callable[..., None]:
    """The benchmarks' plain training step: ``zero_grad(); mse_loss(model(x), y).backward(); step()``."""
    def train(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    return train


def rotating_rounds(variants: Sequence[str], time_block: Callable[[str], float], rounds: int) -> dict[str, list[float]]:
    """``time_block(variant)`` of every variant in each of ``rounds`` rounds, the order rotating
    every round, so drift and outside load hit every variant alike; the samples by variant."""
    variants = tuple(variants)
    samples: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(rounds):
        for variant in variants[r % len(variants):] + variants[: r % len(variants)]:
            samples[variant].append(time_block(variant))
    return samples


def max_weight_diffs(make_step: Callable[[str], tuple[Callable, torch.nn.Module]], variants: Sequence[str],
                     batches: list, steps: int = 5, reference: str = "plain") -> dict[str, float]:
    """Largest |weight - reference's weight| of each variant after ``steps`` steps on ``batches``;
    ``make_step(variant)`` gives a step function and its model, all from the same weights."""
    weights = {}
    for variant in variants:
        step, model = make_step(variant)
        for i in range(steps):
            step(*batches[i % len(batches)])
        weights[variant] = [p.detach().clone() for p in model.parameters()]
    return {variant: max((a - b).abs().max().item() for a, b in zip(weights[variant], weights[reference]))
            for variant in variants}
