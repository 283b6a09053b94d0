"""Worker functions for the hierarchical all-reduce tests: 4 workers on 2 "hosts" of this machine.

127.0.0.1 and 127.0.0.2 are both loopback here, so every worker can reach every other,
but the cluster names two hosts with two workers each: the transport groups them by
host as it would on two machines (each host's workers share one file in /dev/shm).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

import unison
from tests.multi_worker import _workers as w
from tests.multi_worker._workers import global_batches, mlp_and_step
from unison._collectives.transport.cross_worker import HierarchicalTransport

HOSTS = ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.2:3", "127.0.0.2:4"]  # never bound: run_workers provides the store


UNEQUAL_HOSTS = ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.2:3"]  # two workers on one host, one on the other


def strategy_on_hosts(rank: int, implementation: str, hosts: list[str] = HOSTS,
                      bytes_per_pack: int = 0) -> unison.MultiWorkerMirroredStrategy:
    spec = unison.ClusterSpec({"worker": hosts})
    resolver = unison.SimpleClusterResolver(spec, task_type="worker", task_id=rank)
    options = unison.CommunicationOptions(implementation=implementation, timeout_seconds=30,
                                          bytes_per_pack=bytes_per_pack)
    return unison.MultiWorkerMirroredStrategy(resolver, options, devices=["cpu:0"])


def batch_of(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(40 + rank)
    return [torch.randn(1001, generator=g), torch.randn(3, 5, generator=g, dtype=torch.float64),
            torch.arange(6, dtype=torch.int64) * (rank + 1)]


def reduce_batches(rank: int, world: int, implementation: str, hosts: list[str] = HOSTS):
    """Sums and means of a mixed batch; the transport used; whether the engine shared memory;
    how the hosts' sums were added (each worker's slice with its column, or by the leaders)."""
    strategy = strategy_on_hosts(rank, implementation, hosts)
    ops = strategy.extended.cross_device_ops
    pairs = [(unison.PerReplica([t]), "cpu:0") for t in batch_of(rank)]
    sums = [t.clone() for t in strategy.extended.batch_reduce_to("sum", pairs)]
    means = [t.clone() for t in strategy.extended.batch_reduce_to("mean", pairs)]
    transport = ops.transport
    hierarchical = isinstance(transport, HierarchicalTransport)
    return {
        "sums": sums, "means": means, "hierarchical": hierarchical,
        "shared": hierarchical and transport.shared_memory.available and bool(transport.shared_memory._segments),
        "across_hosts": None if not hierarchical else "columns" if transport.share._column is not None else "leaders",
    }


class _SlowClock:
    """``time`` for the link probe of one worker: a second passes at every reading."""

    def __init__(self):
        self._now = 0.0

    def perf_counter(self) -> float:
        self._now += 1.0
        return self._now


def train(rank: int, world: int, implementation: str, slow_probe_rank: int | None = None):
    """The multi-worker MLP of test_two_workers_match_single_device, on 4 workers of 2 hosts
    (``slow_probe_rank``: that worker's probe of the link between hosts reads 1 MB a second)."""
    if rank == slow_probe_rank:
        from unison._collectives.transport import host_share
        host_share.time = _SlowClock()  # this worker process only
    strategy = strategy_on_hosts(rank, implementation)
    model, step = mlp_and_step(strategy, 2, 16)

    for x, y in global_batches():
        strategy.run(step, args=(x.chunk(world)[rank], y.chunk(world)[rank]))
    sync = strategy.extended.components.gradient_sync
    return {
        "weights": [p.detach().clone() for p in model.parameters()],
        "buckets": sync.buckets_in_shared_memory,
        "bucket_bytes": sync.overlap_bucket_bytes,  # where buckets cross hosts: chosen by a probe of the link
        "hierarchical": isinstance(strategy.extended.cross_device_ops.transport, HierarchicalTransport),
    }


class _PauseInBackward(torch.autograd.Function):
    """The identity, whose backward calls ``wait`` (a barrier of every worker): each worker
    of a host has posted the buckets of the layers after it before any worker's backward
    goes on past it, however late the scheduler runs a worker."""

    @staticmethod
    def forward(ctx, x, wait):
        ctx.wait = wait
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.wait()
        return grad, None


class _Pause(nn.Module):
    def __init__(self, wait: Callable[[], None] | None = None):
        super().__init__()
        self.wait = wait if wait is not None else (lambda: None)

    def forward(self, x):
        return _PauseInBackward.apply(x, self.wait)


class FileBarrier:
    """A barrier of ``world`` workers through files in ``directory``, one round per call.

    Files, not a collective: a collective issued in the middle of backward would interleave
    with the buckets' own all-reduces, in a different order on each worker.
    """

    def __init__(self, directory: str, rank: int, world: int, timeout: float = 60.0):
        self._directory, self._rank, self._world, self._timeout = Path(directory), rank, world, timeout
        self._round = 0

    def __call__(self) -> None:
        name = f"round-{self._round}"
        (self._directory / f"{name}-rank-{self._rank}").touch()
        deadline = time.monotonic() + self._timeout
        while len(list(self._directory.glob(f"{name}-rank-*"))) < self._world:
            if time.monotonic() > deadline:
                raise TimeoutError(f"barrier {name} in {self._directory}: not every one of "
                                   f"{self._world} workers arrived within {self._timeout:g} s")
            time.sleep(0.005)
        self._round += 1


def make_paused_mlp(out_of_order: bool = False, pause: Callable[[], None] | None = None) -> nn.Module:
    """An MLP with a pause in backward after its last three layers, its layers made in
    forward order (so its first buckets are backward's first gradients), or, with
    ``out_of_order``, the hidden layers first (as ``make_mlp`` does), so that reverse
    registration order is not backward's order. The pause calls ``pause()`` (by default
    nothing)."""
    torch.manual_seed(0)
    if out_of_order:
        hidden = [nn.Linear(16, 16), nn.Linear(16, 16)]
        first, last = nn.Linear(8, 16), nn.Linear(16, 4)
    else:
        first = nn.Linear(8, 16)
        hidden = [nn.Linear(16, 16), nn.Linear(16, 16)]
        last = nn.Linear(16, 4)
    return nn.Sequential(first, nn.ReLU(), _Pause(pause), hidden[0], nn.ReLU(), hidden[1], nn.ReLU(), last)


def paused_mlp_single_device_weights(out_of_order: bool = False) -> list[torch.Tensor]:
    model = make_paused_mlp(out_of_order)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in global_batches(steps=8):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def train_pipelined(rank: int, world: int, out_of_order: bool, barrier_directory: str):
    """``make_paused_mlp`` with one bucket per gradient or so (64-byte buckets): the buckets of
    the layers after the pause must start across hosts before backward ends (from the
    second step on when the buckets first had to learn backward's order). The pause is a
    barrier of every worker (in ``barrier_directory``), so this holds on a busy machine too."""
    strategy = strategy_on_hosts(rank, "AUTO", bytes_per_pack=64)
    with strategy.scope():
        model = make_paused_mlp(out_of_order, pause=FileBarrier(barrier_directory, rank, world))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sync = strategy.extended.components.gradient_sync
    started = []

    def step(x, y):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        started.append(sync.bucket_transport.started_during_backward)
        opt.step()

    for x, y in global_batches(steps=8):
        strategy.run(step, args=(x.chunk(world)[rank], y.chunk(world)[rank]))
    after_pause = {id(p) for layer in list(model)[3:] for p in layer.parameters()}
    return {
        "weights": [p.detach().clone() for p in model.parameters()],
        "pipelined": sync.crosses_hosts_during_backward,
        "buckets": len(sync.buckets_in_shared_memory),
        # buckets whose gradients all come before the pause in backward
        "before_pause": sum(all(id(p) in after_pause for p in bucket.params) for bucket in sync._buckets),
        "started": started,
    }


def two_heads_on_hosts_with_late_trips(rank: int, world: int):
    """``two_heads_on_hosts`` where the second step's trip between hosts keeps its slice of the
    file after its wait returned, until the next trip starts, as gloo's worker thread holds a
    finished work until it gets round to dropping it (under load, past the next step's first
    gradient). Nothing handed out to the gradients is held, so no bucket may leave its home."""
    from unison._collectives.transport import host_share

    made = host_share._trip
    trips = 0
    late: list[torch.Tensor] = []

    def trip_keeping_its_slice(across, tensor, compressor):
        nonlocal trips
        trips += 1
        late[:] = [tensor] if trips == 2 else []  # one bucket: a trip a step
        return made(across, tensor, compressor)

    host_share._trip = trip_keeping_its_slice
    try:
        return two_heads_on_hosts(rank, world)
    finally:
        host_share._trip = made


def two_heads_on_hosts(rank: int, world: int):
    """``TwoHeads`` (24 gradients: one bucket in flat slots) trained with AdamW on two hosts of
    two workers, heads skipped on some steps (``_train_two_heads``). Each worker keeps its first
    layer's gradient of step 2 (and a copy): its bucket must leave its home in the shared file,
    never writing into the kept tensor again. Reports, per step,
    whether every bucket had its home in the file and whether its gradients lived in slots."""
    strategy = strategy_on_hosts(rank, "AUTO")
    with strategy.scope():
        model = w.TwoHeads()
    sync = strategy.extended.components.gradient_sync
    first = model.trunk[0].weight
    kept: list[torch.Tensor] = []
    homes: list[tuple[bool, bool]] = []

    def run_step(step, x, y, heads):
        def probed(x, y, heads):
            skipped = step(x, y, heads)  # zero_grad, backward, AdamW's step
            buckets = sync._buckets
            homes.append((all(b.home is not None for b in buckets), all(b.slots is not None for b in buckets)))
            if len(homes) == 3:
                kept.extend([first.grad, first.grad.clone()])
            return skipped
        return strategy.run(probed, args=(x, y, heads))

    weights, skipped = w._train_two_heads(model, run_step, rank, world)
    return {
        "weights": weights, "skipped": skipped, "pipelined": sync.crosses_hosts_during_backward,
        "homes": homes, "kept_unchanged": torch.equal(kept[0], kept[1]),
    }
