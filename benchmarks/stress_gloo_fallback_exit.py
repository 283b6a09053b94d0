"""Stress loop (not a benchmark, not a test): do 2-worker jobs on the gloo fallback exit cleanly?

Issue 45 item B: one 2-worker job whose shared memory was unusable (no
``os.posix_fallocate``, so every all-reduce fell back to gloo) trained exactly but exited
with 134 (SIGABRT at exit); it showed once in 46 runs. This script runs such a job
``--runs`` times through ``python -m unison.launch --workers 2`` and counts the launcher's
exit codes. Each worker removes ``os.posix_fallocate`` before it imports unison, trains
an MLP for a few steps under MultiWorkerMirroredStrategy (gradient buckets and a batch
reduction through gloo), checks that the shared memory really was refused and that
both workers hold the same weights, and returns. ``PYTHONFAULTHANDLER=1`` is set, so an
abort dumps every thread's Python stack; a failed run's stdout and stderr are written to
``<out>/failure-<n>.txt``.

``--hogs K`` starts K busy-looping processes for the duration, so the workers' exit
paths are scheduled late and in odd orders (the machine has 2 cores); ``--skew S`` has
each worker sleep up to S seconds before it exits, so they leave in either order and at
any distance.

Usage:
    PYTHONPATH=src python benchmarks/stress_gloo_fallback_exit.py [--runs 200] [--hogs 1] [--out DIR]
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing
import os
import subprocess
import sys
import tempfile
import textwrap
import time
import typing
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

JOB = textwrap.dedent("""
    import os
    del os.posix_fallocate  # as on a platform without it: shared memory is refused, gloo carries everything
    import torch
    import unison

    torch.manual_seed(0)
    strategy = unison.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    total = strategy.extended.batch_reduce_to("sum", [(torch.ones(8), torch.ones(8))])
    transport = strategy.extended.cross_device_ops.transport.shared_memory
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    sums = strategy.extended.batch_reduce_to("sum", [(torch.tensor([checksum, 1.0]), torch.tensor([0.0, 0.0]))])
    same = abs(float(sums[0][0]) - sums[0][1] * checksum) < 1e-9 * max(1.0, abs(checksum))
    sum_ok = bool(torch.equal(total[0], torch.full((8,), 2.0)))
    print(f"fallback={not transport.available} same_weights={same} sum_ok={sum_ok}", flush=True)
    if USER_DESTROY:  # as many scripts end: the default group destroyed by the user
        torch.distributed.destroy_process_group()
    if SKEW:
        import random, time
        time.sleep(random.uniform(0, SKEW))  # the workers reach their exits in any order, at any distance
""")


def _hog(stop: typing.Any, parent: int) -> None:
    while not stop.is_set() and os.getppid() == parent:  # ends with this script, however it ends
        sum(range(10_000))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--steps", type=int, default=5, help="training steps per job")
    parser.add_argument("--hogs", type=int, default=0, help="busy-looping processes beside the jobs")
    parser.add_argument("--skew", type=float, default=0.0,
                        help="each worker sleeps up to this many seconds (uniform) after training, before it exits")
    parser.add_argument("--user-destroy", action="store_true",
                        help="the job calls torch.distributed.destroy_process_group() itself after training")
    parser.add_argument("--nice", type=int, default=0,
                        help="run the jobs at this niceness, so the hogs (at the caller's) take the cores first")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds one job may take")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out" / "stress_gloo_fallback_exit")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONFAULTHANDLER="1", OMP_NUM_THREADS="1")
    # Buffered stdout and stderr, as a job started from a plain shell or a scheduler has them
    # (PYTHONUNBUFFERED makes them raw, and a daemon thread's late write then cannot abort).
    env.pop("PYTHONUNBUFFERED", None)
    # The launched workers import unison from wherever this script found it.
    import unison
    src = str(Path(unison.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [os.environ.get("PYTHONPATH")])])
    stop = multiprocessing.Event()
    hogs = [multiprocessing.Process(target=_hog, args=(stop, os.getpid()), daemon=True) for _ in range(args.hogs)]
    for hog in hogs:
        hog.start()
    codes: collections.Counter[int] = collections.Counter()
    bad_output = 0
    started = time.monotonic()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            script = Path(tmp) / "job.py"
            script.write_text(JOB.replace("STEPS", str(args.steps)).replace("SKEW", repr(args.skew))
                              .replace("USER_DESTROY", repr(args.user_destroy)))
            for run in range(1, args.runs + 1):
                try:
                    command = [sys.executable, "-m", "unison.launch", "--workers", "2", str(script)]
                    if args.nice:
                        command = ["nice", "-n", str(args.nice), *command]
                    done = subprocess.run(command,
                                          cwd=tmp, env=env, capture_output=True, text=True, timeout=args.timeout)
                    code, stdout, stderr = done.returncode, done.stdout, done.stderr
                except subprocess.TimeoutExpired as exc:
                    code, stdout, stderr = -999, str(exc.stdout or ""), str(exc.stderr or "")
                codes[code] += 1
                good = stdout.count("fallback=True same_weights=True sum_ok=True") == 2
                if not good:
                    bad_output += 1
                if code != 0 or not good:
                    failure = args.out / f"failure-{run}.txt"
                    failure.write_text(f"exit code {code}\n--- stdout\n{stdout}\n--- stderr\n{stderr}\n")
                    print(f"run {run}: exit {code}, output ok={good}: {failure}", flush=True)
                if run % 10 == 0:
                    print(f"{run} runs in {time.monotonic() - started:.0f} s: exit codes {dict(codes)}, "
                          f"bad output {bad_output}, load {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        stop.set()
        for hog in hogs:
            hog.join(5)
    print(f"done: {sum(codes.values())} runs, exit codes {dict(codes)}, bad output {bad_output}")
    return 0 if set(codes) == {0} and bad_output == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
