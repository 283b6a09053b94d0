"""Worker functions for the shared-memory all-reduce tests (module level, so spawned processes import them)."""

from __future__ import annotations

import errno
import logging
import os
import signal
import time

import torch

import unison
from tests.multi_worker._workers import global_batches, make_mlp, strategy_for
from unison._collectives.ops.collective import CollectiveAllReduce
from unison._collectives.transport import shared_memory

BIG = 20_011  # float32 elements; prime, so the workers' slices are uneven


def batch_of(rank: int, scale: int = 1) -> list[torch.Tensor]:
    """Mixed dtypes, 1-d, N-d and 0-d tensors."""
    g = torch.Generator().manual_seed(10 + rank)
    return [
        torch.randn(BIG * scale, generator=g),
        torch.randn(7, 13, generator=g),
        torch.tensor(float(rank + 1)),
        torch.arange(6, dtype=torch.int64).reshape(2, 3) * (rank + 1),
        torch.randn(BIG // 2, generator=g, dtype=torch.float64),
        torch.randn(3, 4, 5, generator=g),
    ]


def _pairs(tensors: list[torch.Tensor]) -> list:
    return [(unison.PerReplica([t]), "cpu:0") for t in tensors]


def _exact_sum(world: int, scale: int = 1) -> list[torch.Tensor]:
    """Worker-order sums: what the shared-memory path computes, bit for bit."""
    parts = [batch_of(r, scale) for r in range(world)]
    sums = []
    for tensors in zip(*parts):
        total = tensors[0].clone()
        for t in tensors[1:]:
            total = total + t
        sums.append(total)
    return sums


def _unison_files() -> set[str]:
    """The shared-memory files this process created (worker 0 creates a group's): other tests running
    at the same time create theirs in the same directory."""
    return {name for name in os.listdir(shared_memory.SHARED_MEMORY_DIR) if name.startswith(f"unison-{os.getpid()}-")}


def sums_means_and_reuse(rank: int, world: int):
    """SUM and MEAN through shared memory, against gloo's answer; segments reused; no file left behind."""
    files_before = _unison_files()
    strategy = strategy_for(rank, world, timeout_seconds=30)
    ops = strategy.extended.cross_device_ops
    ring = CollectiveAllReduce(["cpu:0"], ops.worker_group, unison.CommunicationOptions(implementation="RING"))
    mine = batch_of(rank)
    originals = [t.clone() for t in mine]
    sums = strategy.extended.batch_reduce_to("sum", _pairs(mine))
    transport = ops.transport.shared_memory
    segments_after_first = dict(transport._segments)
    means = strategy.extended.batch_reduce_to("mean", _pairs(mine))
    again = strategy.extended.batch_reduce_to("sum", _pairs(mine))
    ring_sums = ring.batch_reduce("sum", _pairs(mine))
    ring_means = ring.batch_reduce("mean", _pairs(mine))
    expected = _exact_sum(world)
    ops.barrier()
    return {
        "used_shared_memory": transport is not None and transport.available and len(segments_after_first) == 3,
        "sums_exact": all(torch.equal(s, e) for s, e in zip(sums, expected)),
        "kept_results_untouched": all(torch.equal(s, e) for s, e in zip(sums, expected)) and all(
            torch.equal(a, e) for a, e in zip(again, expected)),
        "means_as_gloo": all(m.dtype == r.dtype and torch.allclose(m, r, rtol=0, atol=1e-6)
                             for m, r in zip(means, ring_means)),
        "means_are_sums_over_world": all(torch.allclose(m.double(), e.double() / world, rtol=0, atol=1e-6)
                                         for m, e in zip(means, expected)),
        "equal_to_gloo": all(torch.allclose(s, r, rtol=0, atol=1e-5) for s, r in zip(sums, ring_sums)),
        "exactly_gloo": all(torch.equal(s, r) for s, r in zip(sums, ring_sums)),
        "shapes_kept": [s.shape for s in sums] == [t.shape for t in mine],
        "inputs_untouched": all(torch.equal(t, o) for t, o in zip(mine, originals)),
        "segments_reused": all(transport._segments[k] is v for k, v in segments_after_first.items()),
        "files_left": sorted(_unison_files() - files_before),
        "ring_transport": ring.transport.shared_memory,
    }


def mismatch_then_recover(rank: int, world: int):
    """Layout mismatches on the shared-memory path raise on every worker, and the next good call works."""
    strategy = strategy_for(rank, world, timeout_seconds=20)
    reduce = strategy.extended.batch_reduce_to
    good = [torch.ones(BIG), torch.ones(4, 5)]
    reduce("sum", _pairs(good))  # both workers now hold this layout's segment
    cases = {
        "same size, other shape": [torch.ones(BIG), torch.ones(5, 4) if rank == 1 else torch.ones(4, 5)],
        "other size": [torch.ones(BIG + (rank == 1)), torch.ones(4, 5)],
        "another size, new to one worker only": [torch.ones(BIG if rank == 0 else 3), torch.ones(4, 5)],
    }
    outcomes = {}
    for name, tensors in cases.items():
        try:
            reduce("sum", _pairs(tensors))
            outcomes[name] = "no error"
        except unison.errors.CollectiveMismatchError as exc:
            outcomes[name] = str(exc)
    # Workers decide without talking when to create or drop a file, so their caches must
    # stay identical, mismatches or not.
    transport = strategy.extended.cross_device_ops.transport.shared_memory
    cache = (list(transport._segments), sorted(transport._last_used.items(), key=str))
    recovered = reduce("sum", _pairs(good))
    return outcomes, all(torch.equal(r, torch.full_like(g, world)) for r, g in zip(recovered, good)), cache


def cannot_share(rank: int, world: int, how: str, tmp: str):
    """Workers that cannot meet in shared memory fall back to gloo, all of them, with a warning."""
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(f"{record.levelname}: {record.getMessage()}")

    logger = logging.getLogger(shared_memory.__name__)
    logger.addHandler(Keep())
    logger.setLevel(logging.INFO)
    if how == "different hosts":
        own = os.path.join(tmp, f"host-{rank}")  # each worker its own /dev/shm
        os.makedirs(own, exist_ok=True)
        shared_memory.SHARED_MEMORY_DIR = own
    elif how == "no space" and rank == 0:
        def full(fd: int, offset: int, length: int) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        shared_memory.os.posix_fallocate = full  # type: ignore[attr-defined]
    strategy = strategy_for(rank, world, timeout_seconds=30, bytes_per_pack=4 << 10)
    with strategy.scope():  # the buckets would go to shared memory
        model = make_mlp(1, 160)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in global_batches():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        opt.step()
    mine = batch_of(rank)
    first = strategy.extended.batch_reduce_to("sum", _pairs(mine))
    second = strategy.extended.batch_reduce_to("sum", _pairs(mine))
    expected = _exact_sum(world)
    transport = strategy.extended.cross_device_ops.transport.shared_memory
    left = os.listdir(shared_memory.SHARED_MEMORY_DIR) if how == "different hosts" else []
    return {
        "available": transport.available,
        "correct": all(torch.allclose(r, e, rtol=0, atol=1e-5) for r, e in zip(first + second, expected + expected)),
        "warnings": records,
        "files_left": left,
        "shared_buckets": strategy.extended.components.gradient_sync.buckets_in_shared_memory,
        "weights": [p.detach().clone() for p in model.parameters()],
    }


def many_sizes(rank: int, world: int):
    """More distinct layouts than MAX_SEGMENTS: results stay exact, mapped files stay bounded."""
    strategy = strategy_for(rank, world, timeout_seconds=30)
    transport_sizes = []
    exact = True
    for size in range(shared_memory.MAX_SEGMENTS + 3):
        mine, expected = batch_of(rank, scale=size + 1), _exact_sum(world, scale=size + 1)
        result = strategy.extended.batch_reduce_to("sum", _pairs(mine))
        exact = exact and all(torch.equal(r, e) for r, e in zip(result, expected))
        transport_sizes.append(len(strategy.extended.cross_device_ops.transport.shared_memory._segments))
    small = [torch.ones(5)]
    for _ in range(shared_memory.MAX_IDLE_CALLS + 1):  # every other file goes idle, and is dropped
        exact = exact and torch.equal(strategy.extended.batch_reduce_to("sum", _pairs(small))[0], torch.full((5,), 2.0))
    left = list(strategy.extended.cross_device_ops.transport.shared_memory._segments)
    return exact, max(transport_sizes), left


def killed_during_shared_reduce(rank: int, world: int, timeout: float):
    strategy = strategy_for(rank, world, timeout_seconds=timeout)
    mine = batch_of(rank)
    for step in range(1000):
        if rank == 1 and step == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        started = time.monotonic()
        try:
            strategy.extended.batch_reduce_to("sum", _pairs(mine))
        except unison.errors.PeerLostError as exc:
            return type(exc).__name__, str(exc), time.monotonic() - started, step
    return "no error", "", 0.0, -1



def killed_while_reserving(rank: int, world: int, shm_dir: str):
    """Worker 0 is SIGKILLed at the slowest step of creating a file (reserving its pages)."""
    shared_memory.SHARED_MEMORY_DIR = shm_dir
    if rank == 0:
        def die(fd: int, offset: int, length: int) -> None:
            os.kill(os.getpid(), signal.SIGKILL)
        shared_memory.os.posix_fallocate = die  # type: ignore[attr-defined]
    strategy = strategy_for(rank, world, timeout_seconds=10)
    started = time.monotonic()
    try:
        strategy.extended.batch_reduce_to("sum", _pairs(batch_of(rank)))
    except unison.errors.PeerLostError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - started
    return "no error", "", 0.0


class EmbeddingMLP(torch.nn.Module):
    """A sparse embedding (its gradients travel by all-gather) under dense layers."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embedding = torch.nn.Embedding(10, 4, sparse=True)
        self.layers = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(12)])  # 24 gradients, 960 bytes

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.layers(self.embedding(ids))


def embedding_batches(steps: int = 5, batch: int = 8) -> list:
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, 10, (batch,), generator=g), torch.randn(batch, 4, generator=g)) for _ in range(steps)]


def single_device_embedding_weights() -> list[torch.Tensor]:
    model = EmbeddingMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for ids, y in embedding_batches():
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(ids), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def gradients_in_slots(rank: int, world: int, bytes_per_pack: int):
    """Trains EmbeddingMLP; reports, per step, whether the embedding's gradient stayed sparse and
    whether every dense gradient lived in its bucket's own slots, and whether a gradient kept
    from step 2 still holds its values at the end."""
    strategy = strategy_for(rank, world, bytes_per_pack=bytes_per_pack)
    with strategy.scope():
        model = EmbeddingMLP()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = strategy.extended.components.gradient_sync
    dense = list(model.layers.parameters())
    steps: list[dict] = []
    kept: list[torch.Tensor] = []

    def step(ids, y):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(ids), y).backward()
        slot_storages = {b.slots.flats[torch.float32].untyped_storage().data_ptr()
                         for b in sync._buckets if b.slots is not None}
        steps.append({
            "sparse": model.embedding.weight.grad.is_sparse,
            "dense_in_slots": all(p.grad.untyped_storage().data_ptr() in slot_storages for p in dense),
        })
        if len(steps) == 2:
            kept.extend([dense[0].grad, dense[0].grad.clone()])
        opt.step()

    for ids, y in embedding_batches():
        strategy.run(step, args=(ids.chunk(world)[rank], y.chunk(world)[rank]))
    return {"steps": steps, "kept_unchanged": torch.equal(kept[0], kept[1]),
            "weights": [p.detach().clone() for p in model.parameters()],
            "shared": sync.buckets_in_shared_memory}
