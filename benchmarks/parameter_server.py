"""Parameter-server throughput: unison's ParameterServerStrategy beside MWMS and TensorFlow's PSS.

Workloads (per step, on each worker):
- ``dense``: W1, an MLP 784-1024-1024-10 on batches of 256 (SGD), 7.4 MB of parameters
  pulled and 7.4 MB of gradients pushed per step.
- ``embedding``: a 1,000,000 x 64 float32 table (256 MB) split over the ps tasks, looked
  up by 256 x 8 ids per step, mean-pooled into a linear head (SGD). Only the touched
  rows move; the worker's peak RSS growth over its baseline is measured too.

Variants: unison PS with chief + 2 workers + 1 and 2 ps tasks; MultiWorkerMirrored
(2 workers, batch 256 each) on the dense workload; TensorFlow's ParameterServerStrategy
with the same cluster when ``tensorflow`` can be imported (``--tf-path`` adds a
directory to its ``sys.path``, e.g. one made by ``pip install --target DIR
tensorflow-cpu``). Throughput is samples/s over all workers.

Writes ``<out>/parameter_server.json`` and ``<out>/parameter_server.png``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info  # noqa: E402

import unison  # noqa: E402

BATCH = 256
TABLE_ROWS, TABLE_DIM, IDS_PER_EXAMPLE = 1_000_000, 64, 8
EMBEDDING_STEPS_FACTOR = 8
_CTX = multiprocessing.get_context("spawn")


# -- a local cluster of servers ------------------------------------------------------------
def _serve(job: str, index: int, key_hex: str, conn: Any) -> None:
    torch.set_num_threads(1)
    os.environ["UNISON_AUTHKEY"] = key_hex
    server = unison.Server({job: [f"127.0.0.1:{i + 1}" for i in range(index + 1)]}, job, index,
                           bind_address="127.0.0.1:0")
    conn.send(server.address)
    conn.close()
    server.join()


def _start_cluster(workers: int, ps: int) -> tuple[unison.SimpleClusterResolver, list]:
    key_hex = secrets.token_hex(32)
    os.environ["UNISON_AUTHKEY"] = key_hex
    procs, addresses = [], {}
    for job, count in (("ps", ps), ("worker", workers)):
        for i in range(count):
            parent, child = _CTX.Pipe()
            proc = _CTX.Process(target=_serve, args=(job, i, key_hex, child), daemon=True)
            proc.start()
            procs.append((proc, parent, f"{job}:{i}"))
    for _proc, parent, name in procs:
        addresses[name] = parent.recv()
    spec = unison.ClusterSpec({"chief": ["127.0.0.1:1"],
                               "worker": [addresses[f"worker:{i}"] for i in range(workers)],
                               "ps": [addresses[f"ps:{i}"] for i in range(ps)]})
    return unison.SimpleClusterResolver(spec, task_type="chief", task_id=0), [(p, name) for p, _, name in procs]


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used so far (Linux ``/proc``; 0 elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _warm_memory_kb() -> dict[str, int]:
    """A worker's baseline: resident set after one plain local PyTorch step of a tiny
    embedding model (so the code PyTorch pages in for any training is counted there)."""
    model = nn.Sequential(nn.Embedding(16, TABLE_DIM), nn.Flatten(), nn.Linear(TABLE_DIM * 2, 1))
    model(torch.randint(0, 16, (4, 2))).sum().backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    return _memory_kb()


def _memory_kb() -> dict[str, int]:
    """This process's current and peak resident set (VmRSS, VmHWM) in kB."""
    from unison._ps.worker.runtime import RUNTIME

    out = {"worker": RUNTIME.current.worker_index}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM")):
                key, value = line.split(":")
                out[key] = int(value.split()[0])
    return out


# -- unison PS ------------------------------------------------------------------------------
def run_unison(workload: str, workers: int, ps: int, steps: int, warmup: int) -> dict[str, Any]:
    resolver, procs = _start_cluster(workers, ps)
    try:
        strategy = unison.ParameterServerStrategy(
            resolver,
            variable_partitioner=unison.partitioners.FixedShardsPartitioner(ps) if workload == "embedding" else None)
        coordinator = unison.ClusterCoordinator(strategy)
        torch.manual_seed(0)
        with strategy.scope():
            if workload == "dense":
                model = nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                                      nn.Linear(1024, 10))
            else:
                model = nn.ModuleDict({"table": nn.Embedding(TABLE_ROWS, TABLE_DIM), "head": nn.Linear(TABLE_DIM, 1)})
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

        def dataset_fn(context: unison.InputContext) -> list:
            g = torch.Generator().manual_seed(context.input_pipeline_id)
            if workload == "dense":
                return [(torch.randn(BATCH, 784, generator=g), torch.randint(0, 10, (BATCH,), generator=g))
                        for _ in range(8)]
            return [(torch.randint(0, TABLE_ROWS, (BATCH, IDS_PER_EXAMPLE), generator=g),
                     torch.rand(BATCH, generator=g))
                    for _ in range(8)]

        def forever(batches):
            while True:
                yield from batches

        iterator = iter(coordinator.create_per_worker_dataset(lambda ctx: forever(dataset_fn(ctx))))

        def step(it):
            x, y = next(it)
            if workload == "dense":
                loss = F.cross_entropy(model(x), y)
            else:
                loss = F.mse_loss(model["head"](model["table"](x).mean(1)).squeeze(1), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            return loss.detach()

        fresh = [coordinator.schedule(_memory_kb) for _ in range(2 * workers)]
        coordinator.join()
        baseline = [coordinator.schedule(_warm_memory_kb) for _ in range(2 * workers)]
        for _ in range(warmup):
            coordinator.schedule(step, args=(iterator,))
        coordinator.join()
        cpu_before = {name: _cpu_seconds(proc.pid) for proc, name in procs}
        chief_before = time.process_time()
        start = time.perf_counter()
        losses = [coordinator.schedule(step, args=(iterator,)) for _ in range(steps)]
        coordinator.join()
        elapsed = time.perf_counter() - start
        # CPU milliseconds per step by role: less noisy than throughput on a shared machine
        cpu_ms = {role: sum(_cpu_seconds(proc.pid) - cpu_before[name] for proc, name in procs if name.startswith(role))
                  * 1000 / steps for role in ("ps", "worker")}
        cpu_ms["chief"] = (time.process_time() - chief_before) * 1000 / steps
        after = [coordinator.schedule(_memory_kb) for _ in range(4 * workers)]
        coordinator.join()
        # per worker: its peak after training minus its own baseline; the larger of the workers
        def by_worker(values: list, key: str) -> dict[int, float]:
            return {v.fetch()["worker"]: v.fetch()[key] / 1024 for v in values}

        peak, warm, start = by_worker(after, "VmHWM"), by_worker(baseline, "VmRSS"), by_worker(fresh, "VmRSS")
        result = {"samples_per_s": steps * BATCH / elapsed, "steps": steps, "seconds": elapsed,
                  "cpu_ms_per_step": {role: round(v, 2) for role, v in cpu_ms.items()},
                  "last_loss": losses[-1].fetch().item(), "worker_peak_rss_mb": max(peak.values()),
                  "worker_peak_rss_growth_mb": max(peak[w] - warm[w] for w in peak if w in warm),
                  "worker_peak_rss_growth_from_fresh_mb": max(peak[w] - start[w] for w in peak if w in start)}
        coordinator.shutdown()
        return result
    finally:
        for proc, _ in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()


# -- MultiWorkerMirrored (dense only) ----------------------------------------------------------
def _mwms_worker(rank: int, world_size: int, steps: int, warmup: int) -> float:
    spec = unison.ClusterSpec({"worker": ["127.0.0.1:1", "127.0.0.1:2"]})
    strategy = unison.MultiWorkerMirroredStrategy(unison.SimpleClusterResolver(spec, task_type="worker", task_id=rank))
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(BATCH, 784, generator=g), torch.randint(0, 10, (BATCH,), generator=g)) for _ in range(8)]

    def step(i: int) -> None:
        x, y = batches[i % 8]
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    for i in range(warmup):
        step(i)
    start = time.perf_counter()
    for i in range(steps):
        step(i)
    return time.perf_counter() - start


def run_mwms(steps: int, warmup: int) -> dict[str, Any]:
    from unison._testing import run_workers

    seconds = max(run_workers(_mwms_worker, 2, args=(steps, warmup), timeout=300))
    return {"samples_per_s": 2 * steps * BATCH / seconds, "steps_per_worker": steps, "seconds": seconds}


# -- TensorFlow's ParameterServerStrategy --------------------------------------------------------
def run_tensorflow(workload: str, ps: int, steps: int, warmup: int, tf_path: str | None) -> dict[str, Any] | None:
    script = Path(__file__).resolve().parent / "_tf_parameter_server.py"
    env = dict(os.environ)
    if tf_path:
        env["PYTHONPATH"] = tf_path + os.pathsep + env.get("PYTHONPATH", "")
    probe = subprocess.run([sys.executable, "-c", "import tensorflow"], env=env, capture_output=True)
    if probe.returncode != 0:
        return None
    done = subprocess.run([sys.executable, str(script), workload, str(ps), str(steps), str(warmup)],
                          env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        return {"error": done.stderr[-2000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, workload in zip(axes, ("dense", "embedding")):
        names = [n for n, r in results[workload].items() if r and "samples_per_s" in r]
        ax.bar(names, [results[workload][n]["samples_per_s"] for n in names], color="tab:blue")
        ax.set_title(f"{workload} workload, batch {BATCH} per worker step")
        ax.set_ylabel("samples/s (all workers)")
        ax.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60,
                        help=f"timed steps per variant (default 60; x{EMBEDDING_STEPS_FACTOR} "
                             "for the embedding workload)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--tf-path", default=None, help="a directory to add to TensorFlow's sys.path")
    parser.add_argument("--workloads", nargs="+", choices=("dense", "embedding"), default=["dense", "embedding"],
                        help="which workloads to run (default both)")
    parser.add_argument("--ps", nargs="+", type=int, choices=(1, 2), default=[1, 2],
                        help="numbers of ps tasks to run (default 1 and 2)")
    parser.add_argument("--skip-mwms", action="store_true", help="skip the MultiWorkerMirrored baseline")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    args = parser.parse_args(argv)
    results: dict[str, Any] = {"dense": {}, "embedding": {}}
    for workload in args.workloads:
        steps = args.steps * (EMBEDDING_STEPS_FACTOR if workload == "embedding" else 1)  # its steps are short
        for ps in args.ps:
            results[workload][f"unison_ps_2w_{ps}ps"] = run_unison(workload, 2, ps, steps, args.warmup)
            print(workload, ps, results[workload][f"unison_ps_2w_{ps}ps"], flush=True)
            tf = run_tensorflow(workload, ps, steps, args.warmup, args.tf_path)
            if tf is not None:
                results[workload][f"tf_pss_2w_{ps}ps"] = tf
                print(workload, ps, "tf", tf, flush=True)
    if not args.skip_mwms:
        results["dense"]["mwms_2w"] = run_mwms(args.steps // 2, args.warmup)
        print("mwms", results["dense"]["mwms_2w"], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"machine": machine_info(), "batch_per_worker_step": BATCH, "results": results}
    (args.out / "parameter_server.json").write_text(json.dumps(record, indent=1) + "\n")
    plot(results, args.out / "parameter_server.png")
    print(f"wrote {args.out / 'parameter_server.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
