"""One worker of ``benchmarks/multi_host.py``, started by ``unison launch`` on a simulated host.

``python _multi_host_worker.py OUT CONFIG_JSON``: builds, in this process, the same model
three times from one seed -- under ``MultiWorkerMirroredStrategy`` with its defaults (on
two hosts of two workers: the hierarchical transport), under the same with
``implementation="RING"`` (flat gloo), and as ``DistributedDataParallel`` on the group
unison formed -- then times interleaved rounds of each (the order rotating) and writes
``OUT/worker:<i>.json``: every step time, which transport each strategy chose, the
largest weight difference to DDP after the same steps on the same data, and the share of
the machine's CPU time that was busy while each variant's steps ran. With
``"suite": "compression"`` in the configuration it runs the variants of
``_multi_host_compression.py`` instead (issue 45).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import interleaved_rounds  # noqa: E402

import unison  # noqa: E402
from multi_worker import _make_batches, _make_model, _make_step  # noqa: E402  (the same workloads)

VARIANTS = ("ddp", "hierarchical", "ring", "no_sync")
"""``no_sync``: a reference, each worker training its own model alone (no communication): the ceiling."""


def _strategy(implementation: str, timeout: float) -> unison.MultiWorkerMirroredStrategy:
    options = unison.CommunicationOptions(implementation=implementation, timeout_seconds=timeout)
    return unison.MultiWorkerMirroredStrategy(communication_options=options)


def _transport(strategy: unison.MultiWorkerMirroredStrategy) -> str:
    return type(strategy.extended.cross_device_ops.transport).__name__


def _machine_ticks() -> tuple[int, int]:
    """The whole machine's busy and idle CPU ticks so far (``/proc/stat``; both simulated hosts share it)."""
    with open("/proc/stat") as stat:
        user, nice, system, idle, iowait, irq, softirq, *_ = map(int, stat.readline().split()[1:])
    return user + nice + system + irq + softirq, idle + iowait


def _counting_busy(step: Callable, ticks: list[int]) -> Callable:
    """``step``, adding the machine's busy and idle ticks during each call to ``ticks``.

    Where every core is busy whichever transport runs, the step time is the workers' CPU
    work, not the time on the wire: this says which regime a run was in.
    """
    def counted(x: torch.Tensor, y: torch.Tensor) -> None:
        busy, idle = _machine_ticks()
        step(x, y)
        busy_after, idle_after = _machine_ticks()
        ticks[0] += busy_after - busy
        ticks[1] += idle_after - idle

    return counted


def _train(workload: str, cfg: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    hierarchical, ring = _strategy("AUTO", cfg["timeout"]), _strategy("RING", cfg["timeout"])
    batches, loss_fn = _make_batches(workload, cfg["num_batches"])
    per = batches[0][0].shape[0] // world
    local = [(x[rank * per:(rank + 1) * per].clone(), y[rank * per:(rank + 1) * per].clone()) for x, y in batches]
    models: dict[str, nn.Module] = {}
    steps: dict[str, Callable] = {}
    for name, strategy in (("hierarchical", hierarchical), ("ring", ring)):
        with strategy.scope():
            models[name] = _make_model(workload)
            steps[name] = _make_step(models[name], torch.optim.SGD(models[name].parameters(), lr=0.01), loss_fn)
    ddp = nn.parallel.DistributedDataParallel(_make_model(workload))  # on the group unison formed
    models["ddp"] = ddp.module
    steps["ddp"] = _make_step(ddp, torch.optim.SGD(ddp.parameters(), lr=0.01), loss_fn)
    alone = _make_model(workload)  # never reduced: what 4 workers cost with no gradient exchange at all
    steps["no_sync"] = _make_step(alone, torch.optim.SGD(alone.parameters(), lr=0.01), loss_fn)
    ticks = {name: [0, 0] for name in VARIANTS}
    samples, taken = interleaved_rounds({name: _counting_busy(steps[name], ticks[name]) for name in VARIANTS},
                                        local, cfg)
    with torch.no_grad():
        diffs = {name: max((a - b).abs().max().item()
                           for a, b in zip(models[name].parameters(), ddp.module.parameters()))
                 for name in ("hierarchical", "ring")}
    busy = {name: busy / max(busy + idle, 1) for name, (busy, idle) in ticks.items()}
    return {"samples": samples, "weight_diff_vs_ddp": diffs, "steps_taken": taken, "cores_busy": busy,
            "transports": {"hierarchical": _transport(hierarchical), "ring": _transport(ring)}}


def main() -> int:
    out, cfg = Path(sys.argv[1]), json.loads(sys.argv[2])
    torch.set_num_threads(1)  # four processes on a 2-core machine
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    rank = int(task["index"])
    world = sum(len(v) for v in json.loads(os.environ["TF_CONFIG"])["cluster"].values())
    suite = cfg.get("suite", "transports")
    if suite == "compression":  # issue 45: benchmarks/_multi_host_compression.py
        import _multi_host_compression as compression

        result: dict[str, Any] = {"task": f"{task['type']}:{rank}", "train": {
            w: compression.train(w, cfg, rank, world, _counting_busy) for w in cfg["workloads"]}}
        if cfg.get("accuracy"):
            result["accuracy"] = compression.accuracy(cfg, rank, world)
    else:
        result = {"task": f"{task['type']}:{rank}", "train": {w: _train(w, cfg, rank, world) for w in cfg["workloads"]}}
    (out / f"worker:{rank}.json").write_text(json.dumps(result))
    print(f"worker:{rank} done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
