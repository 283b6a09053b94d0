"""Worker functions for compression on the hierarchical transport: 4 workers on 2 "hosts" of this machine.

As in ``_hierarchical_workers.py``, 127.0.0.1 and 127.0.0.2 are both loopback, but the
cluster names two hosts of two workers each (or 2 + 1), so the transport groups them by
host. Every all-reduce on the group between hosts is recorded (its dtype and bytes):
what would cross the network between two machines.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import unison
from tests.collectives.transport._hierarchical_workers import HOSTS
from tests.multi_worker._workers import global_batches, mlp_and_step


def strategy_on_hosts(rank: int, compression: Any, implementation: str = "AUTO",
                      hosts: list[str] = HOSTS) -> unison.MultiWorkerMirroredStrategy:
    spec = unison.ClusterSpec({"worker": hosts})
    resolver = unison.SimpleClusterResolver(spec, task_type="worker", task_id=rank)
    options = unison.CommunicationOptions(implementation=implementation, timeout_seconds=60, compression=compression)
    return unison.MultiWorkerMirroredStrategy(resolver, options, devices=["cpu:0"])


def _share(strategy: unison.MultiWorkerMirroredStrategy) -> Any:
    """The hierarchical transport's HostsShare (PowerSGD: its exact transport's); None on other transports."""
    transport = strategy.extended.cross_device_ops.transport
    transport = getattr(transport, "exact", transport)
    return getattr(transport, "share", None)


class AcrossHosts:
    """Records ``(dtype, bytes)`` of every all-reduce on a strategy's group between hosts, by name."""

    def __init__(self) -> None:
        self.calls: dict[str, list[tuple[str, int]]] = {}
        self._watched: dict[str, Any] = {}
        self._all_reduce = dist.all_reduce
        dist.all_reduce = self._recording  # the transports look it up at each call

    def watch(self, name: str, strategy: unison.MultiWorkerMirroredStrategy) -> None:
        self._watched[name] = _share(strategy)
        self.calls[name] = []

    def _recording(self, tensor: torch.Tensor, *args: Any, group: Any = None, **kwargs: Any) -> Any:
        for name, share in self._watched.items():
            across = None if share is None else share._column or share._leaders
            if across is not None and group is across.group.group:
                self.calls[name].append((str(tensor.dtype), tensor.nbytes))
        return self._all_reduce(tensor, *args, group=group, **kwargs)

    def close(self) -> None:
        dist.all_reduce = self._all_reduce


def train_each(rank: int, world: int) -> dict[str, Any]:
    """The 2-layer MLP of the multi-worker tests, 20 steps, once exact and once each compressed
    (bf16, fp16, PowerSGD rank 1 hierarchical and over RING), in the same processes; the
    weights, the transport names and what crossed between the hosts."""
    recorder = AcrossHosts()
    out: dict[str, Any] = {"weights": {}, "transports": {}}
    try:
        for name, compression, implementation in (
                ("exact", "none", "AUTO"), ("bf16", "bf16", "AUTO"), ("fp16", "fp16", "AUTO"),
                ("powersgd", unison.PowerSGD(rank=1, start_iter=2), "AUTO"),
                ("powersgd_ring", unison.PowerSGD(rank=1, start_iter=2), "RING")):
            strategy = strategy_on_hosts(rank, compression, implementation)
            transport = strategy.extended.cross_device_ops.transport
            out["transports"][name] = [type(transport).__name__,
                                       type(getattr(transport, "exact", transport)).__name__]
            model, step = mlp_and_step(strategy, 2, 16)
            recorder.watch(name, strategy)
            for x, y in global_batches():
                strategy.run(step, args=(x.chunk(world)[rank], y.chunk(world)[rank]))
            out["weights"][name] = [p.detach().clone() for p in model.parameters()]
    finally:
        recorder.close()
    out["across"] = recorder.calls
    return out


def overflowing_fp16_sums(rank: int, world: int, hosts: list[str]) -> dict[str, Any]:
    """Sums of 40000 per worker in float32 (each host's sum overflows float16) and of small
    values, through fp16 compression between hosts; what crossed between them."""
    strategy = strategy_on_hosts(rank, "fp16", hosts=hosts)
    recorder = AcrossHosts()
    try:
        recorder.watch("fp16", strategy)
        large, small = torch.full((300,), 40000.0), torch.full((300,), 0.25 * (rank + 1))
        pairs = [(unison.PerReplica([t]), "cpu:0") for t in (large, small)]
        sums = [t.clone() for t in strategy.extended.batch_reduce_to("sum", pairs)]
    finally:
        recorder.close()
    return {"sums": sums, "across": recorder.calls["fp16"],
            "transport": type(strategy.extended.cross_device_ops.transport).__name__}
