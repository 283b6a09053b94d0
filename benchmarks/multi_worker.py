"""Multi-worker benchmark: plain PyTorch vs DDP vs unison MultiWorkerMirroredStrategy (GitHub issue 4).

One command, one run, three things measured on this machine:

- training throughput (samples/s) with SGD on synthetic data for
  - W1: an MLP 784-1024-1024-10 (6 gradient tensors, 7.45 MB), global batch 256,
  - W2: 200 x Linear(64, 64) as residual ``x + 0.1 * tanh(linear(x))`` blocks (400 small gradient tensors),
    global batch 256,
  - D: one Linear(10, 10) on a global batch of 8, a step of about 100 us where only the
    per-step overhead of the synchronisation counts,
  under ``plain`` (1 process, 1 thread, the whole batch), ``ddp`` (2 processes, gloo,
  ``DistributedDataParallel`` with its defaults), ``unison`` (2 processes,
  ``MultiWorkerMirroredStrategy`` with its defaults, a plain ``zero_grad / backward /
  step`` loop: the two workers share this host, so gradients meet in shared memory) and
  ``unison_ring`` (the same with ``implementation=RING``: gradients over gloo, as DDP's),
  and for reference ``no_sync`` (2 processes each training its own model on its half of
  the batch, never communicating: the ceiling of any 2-process data-parallel run here);
- raw all-reduce of 400 float32 tensors of 16 KB (6.55 MB in all) through unison's packed
  batch all-reduce -- the public ``strategy.extended.batch_reduce_to`` (which also runs a
  small layout-check collective per call) and the bare packed path
  ``CollectiveAllReduce.transport.all_reduce`` without the per-call check -- vs one flat ``dist.all_reduce`` of the same
  bytes (a reused buffer) vs 400 separate ``dist.all_reduce`` calls. unison's rows run
  with its defaults (shared memory between the two workers of this host) and, as
  ``*_ring``, over gloo like the baselines; ``unison_one_tensor`` sends the flat buffer
  itself through unison, to show what packing costs on unison's own transport. For reference also
  ``torch.cat`` + one all_reduce + split (the copy any batch all-reduce that returns new
  tensors makes), ``torch.cat`` into a reused buffer + one all_reduce (the least any
  packing does), the flat buffer as two concurrent halves, and 400 asynchronous calls.

DDP and unison run *interleaved in the same two processes* (one thread each, on a
2-core machine): both models are built from the same seed, and rounds alternate DDP,
unison and the plain baseline (which rank 0 runs alone while rank 1 waits at a barrier),
the order rotating every round, so drift and other load hit every variant alike. Every
step is timed with ``time.perf_counter``; samples/s = 256 / median step time. The
unison/DDP ratio is reported from the medians, from the means, and per round.
After timing, DDP's and unison's weights -- which took the same steps on the same data
-- are compared (tolerance 1e-5), and the packed all-reduce is checked against the sum.

Targets (issues 4 and 14): unison/DDP throughput >= 1.15 on W1, >= 1.25 on W2, >= 1.60 on D; packed batch all-reduce
>= 0.85 x the flat single all_reduce and >= 5 x the 400 separate ones (judged on unison's
defaults; the RING rows show the gloo transport alone, for comparison). They are reported
as PASS/FAIL; the exit code is 1 only for a correctness failure (weights differ from
DDP, or a wrong all-reduce sum), never for a missed performance target.

Writes ``<out>/multi_worker.json`` (all samples, summary, machine) and
``<out>/multi_worker.png``.

Usage:
    python benchmarks/multi_worker.py [--steps N] [--rounds R] [--warmup W] [--quick] [--out DIR]
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
import torch.distributed as dist
from _common import describe, machine_info
from torch import nn

GLOBAL_BATCH = 256
WORLD_SIZE = 2
LR = 0.01
AR_TENSORS, AR_NUMEL = 400, 4096  # 400 x 16 KB of float32
WEIGHT_TOLERANCE = 1e-5
TARGET_VS_FLAT = 0.85
TARGET_VS_SEPARATE = 5.0
TRAIN_VARIANTS = ("plain", "ddp", "unison", "unison_ring", "no_sync", "barrier_only", "bare_reduce", "bare_slots",
                  "bare_slots_hooked")
"""``no_sync`` is a reference, not a data-parallel run: each process trains its own plain model
on its half of the batch and never communicates. Its throughput over DDP's is the most any
2-process data-parallel design can reach on this machine (the goals above it are out of reach).
``barrier_only`` is ``no_sync`` plus one barrier a step through the workers' shared counters
(unison's own): no data moves, but each step waits for the slower worker, as any synchronous
data-parallel step must. What a step costs above ``no_sync`` is reported as a share of DDP's
(``(t - t_no_sync) / (t_ddp - t_no_sync)``, issue 32), and above ``barrier_only`` likewise.
``bare_reduce`` is ``no_sync`` plus the least a synchronous mean of the gradients does, written
out in the step after ``backward()`` on one of unison's shared files: one copy of the gradients
in, one barrier, one sum and one division, one copy out (two slots used in turn, so one barrier
a step suffices). No hooks, no buckets, no checks. A transparent implementation (the user's
plain loop) also needs hooks and an end-of-backward callback, and could save at most the copy in
(gradients that live in the file) or, where the sums come back into each worker's own memory, the
copy out: on a step of few gradients (D) its share is about the least any such design pays.
``bare_slots`` is the other way in, by hand: before ``backward()`` each gradient is pointed at its
place in this worker's part of a shared file, zeroed (so autograd adds into the file: no copy in);
after it, one barrier, each worker sums its half of both parts (scaled by 1/2 as it adds, as DDP
divides first) into both, and a second barrier (the sums are the gradients: no copy out). That is
unison's design for many small gradients (W2) without hooks, checks or bookkeeping: the least that
design pays. ``bare_slots_hooked`` adds what a transparent implementation cannot do without: a
hook after each parameter's gradient accumulation (as DDP's and unison's), each returning at once
but the first of a backward pass. These rows' weights are checked against DDP's like unison's."""
AR_VARIANTS = ("unison_batch_reduce_to", "unison_packed", "unison_one_tensor", "unison_batch_reduce_to_ring",
               "unison_packed_ring", "copy_then_flat", "copy_into_flat", "flat", "flat_halves", "separate",
               "separate_async")
AR_CHECKED = ("unison_batch_reduce_to", "unison_packed", "unison_batch_reduce_to_ring", "unison_packed_ring")
AR_SLOW = ("separate", "separate_async")  # ~100x slower: fewer calls per round
AR_LABELS = {
    "unison_batch_reduce_to": "unison batch_reduce_to (public)",
    "unison_packed": "unison packed (transport, unchecked)",
    "unison_one_tensor": "unison, the flat buffer as 1 tensor",
    "unison_batch_reduce_to_ring": "unison batch_reduce_to, RING (gloo)",
    "unison_packed_ring": "unison packed, RING (gloo)",
    "copy_then_flat": "cat + all_reduce + split (copy ref)",
    "copy_into_flat": "cat into reused buffer + all_reduce",
    "flat": "one flat all_reduce",
    "flat_halves": "flat buffer as 2 concurrent halves",
    "separate": "400 separate all_reduce",
    "separate_async": "400 async all_reduce + wait",
}
WORKLOADS = {
    "W1": "MLP 784-1024-1024-10",
    "W2": "200 x Linear(64, 64), residual",
    "D": "one Linear(10, 10), batch 8",
}
BATCHES = {"W1": GLOBAL_BATCH, "W2": GLOBAL_BATCH, "D": 8}
"""Global batch per workload: D is a tiny step, where per-step overhead is all there is."""
TARGETS = {"W1": 1.15, "W2": 1.25, "D": 1.60}
"""unison/DDP throughput goals (issue 14; for D, DDP's step time over unison's)."""
STEPS_FACTOR = {"W1": 1, "W2": 1, "D": 20}
"""D's steps last about 100 us: more of them per round, so a round is not all timer noise."""


# -- workloads (everything below up to the parent side runs in the worker processes) ---------
class _LinearStack(nn.Module):
    """200 Linear(64, 64) layers, each as ``x + 0.1 * tanh(layer(x))``: every layer gets a gradient, none explodes."""

    def __init__(self, depth: int = 200, width: int = 64):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + 0.1 * torch.tanh(layer(x))
        return x


def _make_model(workload: str) -> nn.Module:
    torch.manual_seed(0)
    if workload == "W1":
        return nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    if workload == "D":
        return nn.Linear(10, 10)
    return _LinearStack()


def _make_batches(workload: str, count: int) -> tuple[list, Callable[..., torch.Tensor]]:
    """``count`` global batches of synthetic data, identical in every process, and the loss."""
    gen = torch.Generator().manual_seed(1234)
    if workload == "W1":
        batches = [(torch.randn(GLOBAL_BATCH, 784, generator=gen), torch.randint(0, 10, (GLOBAL_BATCH,), generator=gen))
                   for _ in range(count)]
        return batches, nn.functional.cross_entropy
    batch, width = BATCHES[workload], (10 if workload == "D" else 64)
    batches = [(torch.randn(batch, width, generator=gen), torch.randn(batch, width, generator=gen))
               for _ in range(count)]
    return batches, nn.functional.mse_loss


def _make_step(model: nn.Module, opt: torch.optim.Optimizer, loss_fn: Callable[..., torch.Tensor]) -> Callable:
    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    return step


def _with_barrier(step: Callable, strategy: Any) -> Callable:
    """``step``, then a barrier of the two workers through unison's shared counters (else its
    group's barrier): the synchronisation alone, with no data."""
    engine = strategy.extended.cross_device_ops.transport.shared_memory

    def synchronised(x: torch.Tensor, y: torch.Tensor) -> None:
        step(x, y)
        engine.sync("benchmark barrier")

    return synchronised


def _bare_reduce_step(model: nn.Module, opt: torch.optim.Optimizer, loss_fn: Callable[..., torch.Tensor],
                      strategy: Any, rank: int) -> Callable:
    """``bare_reduce`` (see TRAIN_VARIANTS): a plain step, and the workers' mean of its gradients
    done by hand on a shared file of unison's (two slots per worker, used in turn)."""
    from unison._collectives.transport.flat_buffers import views_of  # the layout unison's buckets use

    engine = strategy.extended.cross_device_ops.transport.shared_memory
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    segment = engine.new_segment(torch.float32, 2 * numel)  # a collective: both workers, same order
    if segment is None:
        raise SystemExit("bare_reduce: the workers cannot share a file here (unison's log says why)")
    slots = [[peer[turn * numel:(turn + 1) * numel] for peer in segment.inputs] for turn in (0, 1)]
    mine = [views_of(slots[turn][rank], params) for turn in (0, 1)]
    sums = torch.empty(numel)
    sum_views = views_of(sums, params)
    two = torch.tensor(float(WORLD_SIZE), dtype=torch.float64)  # a 0-dim divisor: no wrapping per call
    turn = [0]

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        grads = [p.grad for p in params]
        now = turn[0]
        turn[0] ^= 1
        torch._foreach_copy_(mine[now], grads)
        engine.sync("bare reduce")  # both slots of this turn are written; the other turn's are free
        torch.add(slots[now][0], slots[now][1], out=sums)
        sums.div_(two)
        torch._foreach_copy_(grads, sum_views)
        opt.step()

    return step


def _bare_slots_step(model: nn.Module, opt: torch.optim.Optimizer, loss_fn: Callable[..., torch.Tensor],
                     strategy: Any, rank: int, hooked: bool = False) -> Callable:
    """``bare_slots`` (see TRAIN_VARIANTS): a plain step whose gradients accumulate in this worker's
    part of a shared file; each worker sums its half of every part into all of them (the shared-memory
    engine's own slice sum, the one unison's buckets use).
    ``hooked``: with a hook after each parameter's accumulation that does nothing but note the
    first of a backward pass (``bare_slots_hooked``)."""
    from unison._collectives.transport.flat_buffers import views_of
    from unison._gradient_sync.grad_access import set_grads  # t.grad = g for each pair, in one C-level pass
    from unison._interpose.torch_private import current_graph_task_id

    engine = strategy.extended.cross_device_ops.transport.shared_memory
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    segment = engine.new_segment(torch.float32, numel)  # a collective: both workers, same order
    if segment is None:
        raise SystemExit("bare_slots: the workers cannot share a file here (unison's log says why)")
    parts = segment.inputs[:WORLD_SIZE]  # [rank]: that worker's gradients, then the sums
    mine = views_of(parts[rank], params)
    first_of = [-1]  # the backward pass whose first gradient the hooks saw

    def on_gradient(param: torch.Tensor) -> None:
        if first_of[0] == current_graph_task_id() != -1:
            return
        first_of[0] = current_graph_task_id()

    if hooked:
        for param in params:
            param.register_post_accumulate_grad_hook(on_gradient)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        parts[rank].zero_()
        set_grads(params, mine)  # autograd adds each gradient into its place in the file
        loss_fn(model(x), y).backward()
        engine.sync("bare slots: gradients written")
        # this worker's half of every part, each scaled by 1/2 as it is added (the bits of DDP's
        # dividing first), into all of them: one multiply, one add, one copy over the half
        engine.sum_my_slice_into(parts, WORLD_SIZE)
        engine.sync("bare slots: sums written")
        opt.step()

    return step


class _Runner:
    """A step function, its batches and how many steps it took (so DDP and unison see the same data)."""

    def __init__(self, step: Callable, batches: list):
        self.step, self.batches, self.taken = step, batches, 0

    def run(self, n: int) -> list[float]:
        times = []
        for _ in range(n):
            x, y = self.batches[self.taken % len(self.batches)]
            self.taken += 1
            start = time.perf_counter()
            self.step(x, y)
            times.append(time.perf_counter() - start)
        return times


def _max_abs_diff(ours: Any, theirs: Any) -> float:
    """The largest elementwise difference between two models' parameters, in order."""
    return max((a - b).abs().max().item() for a, b in zip(ours, theirs, strict=True))


def _strategy(rank: int, cfg: dict, implementation: str = "AUTO") -> Any:
    import unison

    spec = unison.ClusterSpec({"worker": ["127.0.0.1:1", "127.0.0.1:2"]})  # rendezvous via UNISON_RENDEZVOUS
    options = unison.CommunicationOptions(bytes_per_pack=cfg["bytes_per_pack"],
                                          timeout_seconds=cfg["collective_timeout"],
                                          implementation=implementation)
    return unison.MultiWorkerMirroredStrategy(
        unison.SimpleClusterResolver(spec, task_type="worker", task_id=rank), communication_options=options
    )


def _train(rank: int, workload: str, cfg: dict) -> dict[str, Any]:
    # A fresh strategy per workload: its gradient buckets then hold only this model's parameters.
    strategy = _strategy(rank, cfg)
    ring_strategy = _strategy(rank, cfg, "RING")
    batches, loss_fn = _make_batches(workload, cfg["num_batches"])
    per = BATCHES[workload] // WORLD_SIZE
    local = [(x[rank * per:(rank + 1) * per].clone(), y[rank * per:(rank + 1) * per].clone()) for x, y in batches]

    with strategy.scope():  # first: leaving the scope forms the process group (unison forms it lazily)
        unison_model = _make_model(workload)
        unison_opt = torch.optim.SGD(unison_model.parameters(), lr=LR)
    with ring_strategy.scope():
        ring_model = _make_model(workload)
        ring_opt = torch.optim.SGD(ring_model.parameters(), lr=LR)
    ddp_model = nn.parallel.DistributedDataParallel(_make_model(workload))  # on the group unison formed
    plain_model = _make_model(workload)
    alone_model = _make_model(workload)  # no_sync: this process's half of the batch, never reduced
    waiting_model = _make_model(workload)  # barrier_only: the same, and a barrier each step
    bare_model = _make_model(workload)  # bare_reduce: the least a mean of the gradients does, by hand
    slots_model = _make_model(workload)  # bare_slots: the same, the gradients accumulated in the shared file
    hooked_model = _make_model(workload)  # bare_slots_hooked: and a hook per parameter
    runners = {
        "plain": _Runner(_make_step(plain_model, torch.optim.SGD(plain_model.parameters(), lr=LR), loss_fn), batches),
        "ddp": _Runner(_make_step(ddp_model, torch.optim.SGD(ddp_model.parameters(), lr=LR), loss_fn), local),
        "unison": _Runner(_make_step(unison_model, unison_opt, loss_fn), local),
        "unison_ring": _Runner(_make_step(ring_model, ring_opt, loss_fn), local),
        "no_sync": _Runner(_make_step(alone_model, torch.optim.SGD(alone_model.parameters(), lr=LR), loss_fn),
                           local),
        "barrier_only": _Runner(_with_barrier(_make_step(waiting_model,
                                                         torch.optim.SGD(waiting_model.parameters(), lr=LR),
                                                         loss_fn), strategy), local),
        "bare_reduce": _Runner(_bare_reduce_step(bare_model, torch.optim.SGD(bare_model.parameters(), lr=LR), loss_fn,
                                                 strategy, rank), local),
        "bare_slots": _Runner(_bare_slots_step(slots_model, torch.optim.SGD(slots_model.parameters(), lr=LR),
                                               loss_fn, strategy, rank), local),
        "bare_slots_hooked": _Runner(_bare_slots_step(hooked_model, torch.optim.SGD(hooked_model.parameters(), lr=LR),
                                                      loss_fn, strategy, rank, hooked=True), local),
    }

    def run(name: str, n: int) -> list[float]:
        dist.barrier()
        if name == "plain" and rank != 0:
            return []  # rank 1 idles at the next barrier while rank 0 runs the 1-process baseline
        return runners[name].run(n)

    steps = cfg["steps"] * STEPS_FACTOR[workload]
    for name in TRAIN_VARIANTS:
        run(name, cfg["warmup"] * STEPS_FACTOR[workload])
    samples: dict[str, list[list[float]]] = {name: [] for name in TRAIN_VARIANTS}
    for r in range(cfg["rounds"]):
        order = TRAIN_VARIANTS[r % len(TRAIN_VARIANTS):] + TRAIN_VARIANTS[:r % len(TRAIN_VARIANTS)]
        if r % 2:  # alternate which of ddp/unison comes first, too
            order = tuple(reversed(order))
        for name in order:
            samples[name].append(run(name, steps))
    dist.barrier()

    with torch.no_grad():
        ddp_params = list(ddp_model.module.parameters())
        unison_params = list(unison_model.parameters())
        weight_diff = _max_abs_diff(ddp_params, unison_params)
        ring_diff = _max_abs_diff(ddp_params, ring_model.parameters())
        bare_diff = _max_abs_diff(ddp_params, bare_model.parameters())
        slots_diff = _max_abs_diff(ddp_params, slots_model.parameters())
        hooked_diff = _max_abs_diff(ddp_params, hooked_model.parameters())
        plain_diff = _max_abs_diff(plain_model.parameters(), ddp_params) if rank == 0 else None
    return {
        "samples": samples,
        "steps_taken": {name: runner.taken for name, runner in runners.items()},
        "max_abs_weight_diff_unison_vs_ddp": weight_diff,
        "max_abs_weight_diff_unison_ring_vs_ddp": ring_diff,
        "max_abs_weight_diff_bare_reduce_vs_ddp": bare_diff,
        "max_abs_weight_diff_bare_slots_vs_ddp": max(slots_diff, hooked_diff),
        "max_abs_weight_diff_plain_vs_ddp": plain_diff,
        "num_gradient_tensors": len(unison_params),
        "gradient_bytes": sum(p.numel() * p.element_size() for p in unison_params),
    }


def _all_reduce(rank: int, cfg: dict) -> dict[str, Any]:
    import unison
    from unison import PerReplica, ReduceOp

    strategy = _strategy(rank, cfg)
    extended = strategy.extended
    ops = extended.cross_device_ops
    ring_strategy = _strategy(rank, cfg, "RING")
    ring_ops = ring_strategy.extended.cross_device_ops

    def inputs(r: int) -> list[torch.Tensor]:
        return [torch.randn(AR_NUMEL, generator=torch.Generator().manual_seed(1000 * r + i)) for i in range(AR_TENSORS)]

    tensors = inputs(rank)
    expected = [sum(parts) for parts in zip(*(inputs(r) for r in range(WORLD_SIZE)))]
    pairs = [(PerReplica([t]), "cpu:0") for t in tensors]
    # Zeros for the in-place baselines: their values then stay finite however often they are summed.
    flat = torch.zeros(AR_TENSORS * AR_NUMEL)
    one_tensor = [torch.cat(tensors)]  # the same bytes as one tensor, through unison
    separate = [torch.zeros(AR_NUMEL) for _ in range(AR_TENSORS)]

    def run_separate_async() -> None:
        works = [dist.all_reduce(t, async_op=True) for t in separate]
        for work in works:
            work.wait()

    def copy_then_flat() -> list[torch.Tensor]:
        # What a batch all-reduce that leaves its inputs untouched and returns 400 tensors
        # does at the least with one collective: copy into a new buffer, reduce it, cut it.
        pack = torch.cat(tensors)
        dist.all_reduce(pack)
        return list(pack.split(AR_NUMEL))

    reused = torch.empty(AR_TENSORS * AR_NUMEL)

    def copy_into_flat() -> None:
        # The least any packing does before one collective: write the inputs into a buffer
        # (here one that is reused, so no fresh pages). On a shared 2-core VM that write
        # alone slows the all_reduce after it by more than its own time (cache refill).
        torch.cat(tensors, out=reused)
        dist.all_reduce(reused)

    def flat_halves() -> None:
        # gloo runs collectives on two worker threads: how much two concurrent halves gain
        # over one all_reduce of the same buffer (unison's packed path sends one).
        works = [dist.all_reduce(half, async_op=True) for half in flat.chunk(2)]
        for work in works:
            work.wait()

    def run_separate() -> None:
        for t in separate:
            dist.all_reduce(t)

    calls: dict[str, Callable[[], Any]] = {
        "unison_batch_reduce_to": lambda: extended.batch_reduce_to(ReduceOp.SUM, pairs),
        "unison_packed": lambda: ops.transport.all_reduce(tensors, 1, _no_check),
        "unison_one_tensor": lambda: ops.transport.all_reduce(one_tensor, 1, _no_check),
        "unison_batch_reduce_to_ring": lambda: ring_strategy.extended.batch_reduce_to(ReduceOp.SUM, pairs),
        "unison_packed_ring": lambda: ring_ops.transport.all_reduce(tensors, 1, _no_check),
        "copy_then_flat": copy_then_flat,
        "copy_into_flat": copy_into_flat,
        "flat": lambda: dist.all_reduce(flat),
        "flat_halves": flat_halves,
        "separate": run_separate,
        "separate_async": run_separate_async,
    }

    # Correctness first: both unison paths must give the plain sum.
    errors = {}
    for name in AR_CHECKED:
        out = calls[name]()
        errors[name] = max((o - e).abs().max().item() for o, e in zip(out, expected))

    def timed(name: str, n: int) -> list[float]:
        dist.barrier()
        times = []
        for _ in range(n):
            start = time.perf_counter()
            calls[name]()
            times.append(time.perf_counter() - start)
        return times

    def n_calls(name: str, n: int) -> int:
        return max(1, n // 5) if name in AR_SLOW else n

    for name in AR_VARIANTS:
        timed(name, n_calls(name, cfg["ar_warmup"]))
    samples: dict[str, list[list[float]]] = {name: [] for name in AR_VARIANTS}
    for r in range(cfg["ar_rounds"]):
        order = AR_VARIANTS[r % len(AR_VARIANTS):] + AR_VARIANTS[:r % len(AR_VARIANTS)]
        for name in order:
            samples[name].append(timed(name, n_calls(name, cfg["ar_calls"])))
    dist.barrier()
    return {"samples": samples, "max_abs_error_vs_sum": errors, "version": unison.__version__}


def _worker(rank: int, world_size: int, cfg: dict) -> dict[str, Any]:
    torch.set_num_threads(1)  # two processes on two cores
    if world_size != WORLD_SIZE:
        raise ValueError(f"the benchmark runs {WORLD_SIZE} workers, got world_size={world_size}")
    result: dict[str, Any] = {"train": {}}
    for workload in cfg["workloads"]:
        result["train"][workload] = _train(rank, workload, cfg)
    result["all_reduce"] = _all_reduce(rank, cfg)
    return result


# -- parent side -------------------------------------------------------------------------------
def _flatten(rounds: list[list[float]]) -> list[float]:
    return [t for r in rounds for t in r]


def summarize(results: list[dict[str, Any]], cfg: dict) -> dict[str, Any]:
    """Samples/s, ratios and checks from rank 0's timings (both ranks' correctness checks)."""
    rank0 = results[0]
    train: dict[str, Any] = {}
    for workload in cfg["workloads"]:
        data = rank0["train"][workload]
        batch = BATCHES[workload]
        rows = {}
        for name in TRAIN_VARIANTS:
            step = describe(_flatten(data["samples"][name]))
            rows[name] = {
                "median_step_ms": step["median"] * 1e3,
                "mean_step_ms": step["mean"] * 1e3,
                "samples_per_s": batch / step["median"],
                "samples_per_s_from_mean": batch / step["mean"],
                "steps_timed": step["n"],
            }
        # Round-wise ratio: per round, DDP's median step time over unison's (> 1: unison faster).
        round_ratios = [statistics.median(d) / statistics.median(u)
                        for d, u in zip(data["samples"]["ddp"], data["samples"]["unison"])]
        weight_diff = max(r["train"][workload]["max_abs_weight_diff_unison_vs_ddp"] for r in results)
        ring_diff = max(r["train"][workload]["max_abs_weight_diff_unison_ring_vs_ddp"] for r in results)
        bare_diff = max(r["train"][workload]["max_abs_weight_diff_bare_reduce_vs_ddp"] for r in results)
        slots_diff = max(r["train"][workload]["max_abs_weight_diff_bare_slots_vs_ddp"] for r in results)
        ratio = rows["unison"]["samples_per_s"] / rows["ddp"]["samples_per_s"]
        ring_ratio = rows["unison_ring"]["samples_per_s"] / rows["ddp"]["samples_per_s"]
        floor_ratio = rows["no_sync"]["samples_per_s"] / rows["ddp"]["samples_per_s"]
        median_ms = {name: row["median_step_ms"] for name, row in rows.items()}

        def above(name: str, floor: str) -> float:
            return (median_ms[name] - median_ms[floor]) / (median_ms["ddp"] - median_ms[floor])  # noqa: B023 - called within the iteration
        train[workload] = {
            "model": WORKLOADS[workload],
            "global_batch": batch,
            "num_gradient_tensors": data["num_gradient_tensors"],
            "gradient_bytes": data["gradient_bytes"],
            "variants": rows,
            "unison_vs_ddp": ratio,
            "unison_vs_ddp_from_mean": (rows["unison"]["samples_per_s_from_mean"]
                                        / rows["ddp"]["samples_per_s_from_mean"]),
            "unison_ring_vs_ddp": ring_ratio,
            "no_sync_vs_ddp": floor_ratio,
            "unison_above_floor": above("unison", "no_sync"),  # issue 32's measure: a share of DDP's
            "barrier_only_above_floor": above("barrier_only", "no_sync"),
            "bare_reduce_above_floor": above("bare_reduce", "no_sync"),
            "bare_slots_above_floor": above("bare_slots", "no_sync"),
            "bare_slots_hooked_above_floor": above("bare_slots_hooked", "no_sync"),
            "unison_above_barrier_floor": above("unison", "barrier_only"),
            "unison_vs_ddp_round_ratios": round_ratios,
            "unison_vs_ddp_round_ratio_summary": describe(round_ratios),
            "ddp_scaling_vs_plain": rows["ddp"]["samples_per_s"] / rows["plain"]["samples_per_s"],
            "unison_scaling_vs_plain": rows["unison"]["samples_per_s"] / rows["plain"]["samples_per_s"],
            "target": TARGETS[workload],
            "pass": ratio >= TARGETS[workload],
            "max_abs_weight_diff_unison_vs_ddp": weight_diff,
            "max_abs_weight_diff_unison_ring_vs_ddp": ring_diff,
            "max_abs_weight_diff_bare_reduce_vs_ddp": bare_diff,
            "max_abs_weight_diff_bare_slots_vs_ddp": slots_diff,
            "weights_match_ddp": max(weight_diff, ring_diff, bare_diff, slots_diff) <= WEIGHT_TOLERANCE,
            "max_abs_weight_diff_plain_vs_ddp": data["max_abs_weight_diff_plain_vs_ddp"],
            "steps_taken": data["steps_taken"],
        }

    nbytes = AR_TENSORS * AR_NUMEL * 4
    ar = rank0["all_reduce"]
    medians = {name: statistics.median(_flatten(ar["samples"][name])) for name in AR_VARIANTS}
    rows = {}
    for name in AR_VARIANTS:
        call = describe(_flatten(ar["samples"][name]))
        rows[name] = {
            "label": AR_LABELS[name],
            "median_ms": call["median"] * 1e3,
            "mean_ms": call["mean"] * 1e3,
            "gb_per_s": nbytes / call["median"] / 1e9,
            "vs_flat": medians["flat"] / call["median"],
            "vs_separate": medians["separate"] / call["median"],
            "vs_copy_then_flat": medians["copy_then_flat"] / call["median"],
            "calls_timed": call["n"],
        }
        if name.startswith("unison"):
            rows[name]["pass_vs_flat"] = rows[name]["vs_flat"] >= TARGET_VS_FLAT
            rows[name]["pass_vs_separate"] = rows[name]["vs_separate"] >= TARGET_VS_SEPARATE
    errors = {name: max(r["all_reduce"]["max_abs_error_vs_sum"][name] for r in results) for name in AR_CHECKED}
    return {
        "train": train,
        "all_reduce": {
            "tensors": AR_TENSORS, "bytes_per_tensor": AR_NUMEL * 4, "total_bytes": nbytes,
            "variants": rows,
            "max_abs_error_vs_sum": errors,
            "sum_correct": all(e <= 1e-4 for e in errors.values()),
            "targets": {"vs_flat": TARGET_VS_FLAT, "vs_separate": TARGET_VS_SEPARATE},
        },
    }


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def format_tables(summary: dict[str, Any]) -> str:
    lines = [
        "Training, SGD, synthetic data, global batch 256 (D: 8); samples/s = batch / median step time",
        "(plain: 1 process x 1 thread; the others 2 processes x 1 thread, interleaved in the same processes;",
        " ddp and unison ring: gradients over gloo; unison: its default, shared memory between the 2 workers;",
        " no_sync/ddp: 2 processes training without any gradient reduction, the ceiling of any data-parallel run)",
        (f"{'workload':<8} {'plain':>8} {'ddp':>8} {'unison':>8} {'ring':>8} {'unison/ddp':>10} {'(mean)':>7} "
         f"{'rounds min..max':>15} {'ring/ddp':>8} {'ddp/plain':>9} {'unison/plain':>12} {'target':>7} {'result':>6} "
         f"{'no_sync/ddp':>11}"),
    ]
    for workload, row in summary["train"].items():
        v, rr = row["variants"], row["unison_vs_ddp_round_ratio_summary"]
        lines.append(
            f"{workload:<8} {v['plain']['samples_per_s']:>8.0f} {v['ddp']['samples_per_s']:>8.0f} "
            f"{v['unison']['samples_per_s']:>8.0f} {v['unison_ring']['samples_per_s']:>8.0f} "
            f"{row['unison_vs_ddp']:>10.3f} {row['unison_vs_ddp_from_mean']:>7.3f} "
            f"{rr['min']:>7.3f}..{rr['max']:<7.3f} {row['unison_ring_vs_ddp']:>8.3f} "
            f"{row['ddp_scaling_vs_plain']:>9.2f} {row['unison_scaling_vs_plain']:>12.2f} "
            f"{'>=' + format(row['target'], '.2f'):>7} {_verdict(row['pass']):>6} {row['no_sync_vs_ddp']:>11.3f}"
        )
    lines.append("Time a step spends above no_sync's, as a share of DDP's (issue 32's goals: W1 <= 0.25, W2 <= 0.30, "
                 "D <= 0.10); and above barrier_only's (no_sync plus one shared-memory barrier a step):")
    for workload, row in summary["train"].items():
        lines.append(
            f"{workload:<8} unison {row['unison_above_floor']:.3f}   barrier_only {row['barrier_only_above_floor']:.3f}"
            f"   unison above barrier_only {row['unison_above_barrier_floor']:.3f}"
            f"   bare_reduce {row['bare_reduce_above_floor']:.3f}   bare_slots {row['bare_slots_above_floor']:.3f}"
            f"   bare_slots_hooked {row['bare_slots_hooked_above_floor']:.3f}"
            f"   (median ms: no_sync {row['variants']['no_sync']['median_step_ms']:.3f}, barrier_only "
            f"{row['variants']['barrier_only']['median_step_ms']:.3f}, "
            f"bare_reduce {row['variants']['bare_reduce']['median_step_ms']:.3f}, "
            f"bare_slots {row['variants']['bare_slots']['median_step_ms']:.3f}, "
            f"bare_slots_hooked {row['variants']['bare_slots_hooked']['median_step_ms']:.3f}, "
            f"unison {row['variants']['unison']['median_step_ms']:.3f}, "
            f"ddp {row['variants']['ddp']['median_step_ms']:.3f})")
    for workload, row in summary["train"].items():
        lines.append(
            f"{workload}: weights match DDP: {'yes' if row['weights_match_ddp'] else 'no'} "
            f"(max |diff| {row['max_abs_weight_diff_unison_vs_ddp']:.2e}, "
            f"ring {row['max_abs_weight_diff_unison_ring_vs_ddp']:.2e}, bare_reduce "
            f"{row['max_abs_weight_diff_bare_reduce_vs_ddp']:.2e}, bare_slots (both) "
            f"{row['max_abs_weight_diff_bare_slots_vs_ddp']:.2e}, after {row['steps_taken']['unison']} "
            f"identical steps; plain vs DDP {row['max_abs_weight_diff_plain_vs_ddp']:.2e})"
        )
    ar = summary["all_reduce"]
    lines += [
        "",
        (f"All-reduce of {ar['tensors']} float32 tensors of {ar['bytes_per_tensor'] // 1024} KB "
         f"({ar['total_bytes'] / 1e6:.2f} MB), 2 processes; baselines over gloo, unison with its defaults "
         f"(shared memory) and over gloo (RING); GB/s = bytes / median call time"),
        (f"{'variant':<36} {'median ms':>9} {'GB/s':>7} {'x flat':>7} {'x separate':>10} {'x copy ref':>10}  "
         f"targets (>= {TARGET_VS_FLAT} flat, >= {TARGET_VS_SEPARATE:g} separate)"),
    ]
    for row in ar["variants"].values():
        verdict = ""
        if "pass_vs_flat" in row:
            verdict = f"{_verdict(row['pass_vs_flat'])}, {_verdict(row['pass_vs_separate'])}"
        lines.append(
            f"{row['label']:<36} {row['median_ms']:>9.3f} {row['gb_per_s']:>7.3f} {row['vs_flat']:>7.3f} "
            f"{row['vs_separate']:>10.2f} {row['vs_copy_then_flat']:>10.3f}  {verdict}"
        )
    errs = ar["max_abs_error_vs_sum"]
    lines.append(
        f"unison's results equal the sum: {'yes' if ar['sum_correct'] else 'no'} (max |error| "
        + ", ".join(f"{AR_LABELS[name]} {error:.1e}" for name, error in errs.items()) + ")"
    )
    return "\n".join(lines)


def plot(summary: dict[str, Any], path: Path, machine: dict[str, Any]) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - matplotlib is the `bench` extra
        print("matplotlib is not installed (pip install unison[bench]): no chart written", file=sys.stderr)
        return False
    colors = {"plain": "#888888", "ddp": "#ee7733", "unison": "#4477aa", "unison_ring": "#66ccee", "no_sync": "#cccccc",
              "barrier_only": "#aaaaaa", "bare_reduce": "#999999", "bare_slots": "#777777",
              "bare_slots_hooked": "#555555"}
    workloads = list(summary["train"])
    columns = max(2, len(workloads))
    top = workloads + workloads[-1:] * (columns - len(workloads))
    bottom = ["ratios"] * (columns // 2) + ["all_reduce"] * (columns - columns // 2)
    fig, axes = plt.subplot_mosaic([top, bottom], figsize=(7 * columns, 8.5))
    for workload in workloads:
        ax = axes[workload]
        row = summary["train"][workload]
        values = [row["variants"][n]["samples_per_s"] for n in TRAIN_VARIANTS]
        bars = ax.bar(["plain\n1 proc", "DDP\n2 procs", "unison\n2 procs", "unison\nRING (gloo)", "no sync\n(ceiling)",
                       "barrier\nonly", "bare\nreduce", "bare\nslots", "bare slots\nhooked"],
                      values,
                      color=[colors[n] for n in TRAIN_VARIANTS])
        notes = [f"{v:.0f}" for v in values]
        notes[2] += f"\n{row['unison_vs_ddp']:.3f}x DDP"
        notes[3] += f"\n{row['unison_ring_vs_ddp']:.3f}x DDP"
        notes[4] += f"\n{row['no_sync_vs_ddp']:.3f}x DDP"
        notes[5] += f"\n{row['barrier_only_above_floor']:.2f}"  # the share above no_sync: see the suptitle
        notes[6] += f"\n{row['bare_reduce_above_floor']:.2f}"
        notes[7] += f"\n{row['bare_slots_above_floor']:.2f}"
        notes[8] += f"\n{row['bare_slots_hooked_above_floor']:.2f}"
        for bar, note in zip(bars, notes):
            ax.annotate(note, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                        fontsize=7)
        ax.tick_params(axis="x", labelsize=7, labelrotation=40)  # nine bars: the labels slant so they do not overlap
        ax.set_ylim(0, max(values) * 1.3)
        ax.set_ylabel("samples/s (median step)")
        ax.set_title(f"{workload}: {row['model']}\n({row['num_gradient_tensors']} gradient tensors, "
                     f"{row['gradient_bytes'] / 1e6:.2f} MB)", fontsize=10)

    ax = axes["ratios"]
    for i, workload in enumerate(workloads):
        ratios = summary["train"][workload]["unison_vs_ddp_round_ratios"]
        ax.scatter([i + (j - len(ratios) / 2) * 0.02 for j in range(len(ratios))], ratios, s=18,
                   color=colors["unison"], alpha=0.7)
        ax.hlines(summary["train"][workload]["unison_vs_ddp"], i - 0.25, i + 0.25, color="black", linewidth=2)
        ax.hlines(summary["train"][workload]["target"], i - 0.35, i + 0.35, color="#cc3311", linestyle="--",
                  linewidth=1, label="target" if i == 0 else None)
    ax.set_xticks(range(len(workloads)), workloads)
    ax.set_xlim(-0.6, len(workloads) - 0.4)
    ax.set_ylabel("unison / DDP throughput")
    ax.set_title("unison / DDP per round (dots), overall median (bar)", fontsize=10)
    ax.legend(loc="lower right", fontsize=8)

    ax = axes["all_reduce"]
    ar = summary["all_reduce"]["variants"]
    names = list(ar)
    values = [ar[n]["gb_per_s"] for n in names]
    bars = ax.barh(range(len(names)), values,
                   color=["#4477aa", "#4477aa", "#4477aa", "#66ccee", "#66ccee", "#999933", "#228833", "#117733",
                          "#cc3311", "#ee6677", "#ee6677"][: len(names)])
    for bar, name in zip(bars, names):
        ax.annotate(f" {ar[name]['gb_per_s']:.2f} GB/s, {ar[name]['vs_flat']:.2f}x flat",
                    (bar.get_width(), bar.get_y() + bar.get_height() / 2), va="center", fontsize=8)
    ax.axvline(ar["flat"]["gb_per_s"] * TARGET_VS_FLAT, color="#cc3311", linestyle="--", linewidth=1,
               label=f"target: {TARGET_VS_FLAT} x one flat all_reduce")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_yticks(range(len(names)), [ar[n]["label"] for n in names], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, max(values) * 1.7)
    ax.set_xlabel("GB/s (6.55 MB / median call time)")
    ax.set_title("all-reduce of 400 x 16 KB float32, 2 processes\n"
                 "(dark blue: unison's defaults; light blue: unison over gloo)",
                 fontsize=10)

    fig.suptitle(f"unison MultiWorkerMirroredStrategy vs DDP vs plain PyTorch -- {machine['cpu_model']}, "
                 f"{machine['usable_cores']} cores, torch {machine['torch']}, {machine['date'][:10]}\n"
                 "(under the barrier and bare bars: their time above no sync's, as a share of DDP's)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _no_check() -> None:
    """The bare transport path: no per-call check (the public path runs one)."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant per round (default 10)")
    parser.add_argument("--rounds", type=int, default=24, help="interleaved rounds (default 24)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps per variant first (default 10)")
    parser.add_argument("--ar-calls", type=int, default=10,
                        help="timed all-reduce calls per variant per round "
                             "(default 10; a fifth for the 400-call variants)")
    parser.add_argument("--ar-rounds", type=int, default=16, help="interleaved all-reduce rounds (default 16)")
    parser.add_argument("--bytes-per-pack", type=int, default=0,
                        help="CommunicationOptions.bytes_per_pack for unison (default 0: unison's defaults)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"comma-separated, of {', '.join(WORKLOADS)} (default: all)")
    parser.add_argument("--quick", action="store_true", help="smoke mode: a few steps and calls (well under 60 s)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out",
                        help="output folder (default benchmarks/out)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.rounds, args.warmup, args.ar_calls, args.ar_rounds = 3, 2, 2, 2, 2
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown or not workloads:
        parser.error(f"--workloads: unknown {unknown or args.workloads!r}; choose from {', '.join(WORKLOADS)}")
    cfg = {
        "workloads": workloads, "steps": args.steps, "rounds": args.rounds, "warmup": args.warmup,
        "num_batches": 8, "ar_calls": args.ar_calls, "ar_rounds": args.ar_rounds, "ar_warmup": 5,
        "bytes_per_pack": args.bytes_per_pack, "collective_timeout": 120.0,
    }
    from unison._testing import run_workers

    machine = machine_info()  # before the run: the load average then says what else was running
    start = time.perf_counter()
    results = run_workers(_worker, WORLD_SIZE, args=(cfg,), timeout=1800.0)
    elapsed = time.perf_counter() - start
    summary = summarize(results, cfg)
    print(format_tables(summary))
    print(f"({elapsed:.0f} s; {machine['cpu_model']}, {machine['usable_cores']} usable cores, "
          f"load average before {machine['load_average_1_5_15']}, torch {machine['torch']})")

    args.out.mkdir(parents=True, exist_ok=True)
    record = {
        "benchmark": "multi_worker",
        "command": "python benchmarks/multi_worker.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "config": {**cfg, "global_batch": BATCHES, "world_size": WORLD_SIZE, "optimizer": f"SGD(lr={LR})",
                   "threads_per_process": 1},
        "summary": summary,
        "samples_rank0_s": {
            "train": {w: results[0]["train"][w]["samples"] for w in cfg["workloads"]},
            "all_reduce": results[0]["all_reduce"]["samples"],
        },
        "elapsed_s": elapsed,
        "machine": machine,
    }
    json_path = args.out / "multi_worker.json"
    json_path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {json_path}")
    png_path = args.out / "multi_worker.png"
    if plot(summary, png_path, machine):
        print(f"wrote {png_path}")
    correct = (all(row["weights_match_ddp"] for row in summary["train"].values())
               and summary["all_reduce"]["sum_correct"])
    return 0 if correct else 1


if __name__ == "__main__":
    sys.exit(main())
