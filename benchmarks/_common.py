"""Small helpers shared by the benchmark scripts: machine description and summary statistics."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
from collections.abc import Sequence
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
