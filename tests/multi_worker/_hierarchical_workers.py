"""Worker functions for the hierarchical all-reduce tests: 4 workers on 2 "hosts" of this machine.

127.0.0.1 and 127.0.0.2 are both loopback here, so every worker can reach every other,
but the cluster names two hosts with two workers each: the transport groups them by
host as it would on two machines (each host's workers share one file in /dev/shm).
"""

from __future__ import annotations

import torch
from torch import nn

import unison
from unison.collectives.transports import HierarchicalTransport

from tests.multi_worker._workers import global_batches, make_mlp

HOSTS = ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.2:3", "127.0.0.2:4"]  # never bound: run_workers provides the store


UNEQUAL_HOSTS = ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.2:3"]  # two workers on one host, one on the other


def strategy_on_hosts(rank: int, implementation: str, hosts: list[str] = HOSTS) -> unison.MultiWorkerMirroredStrategy:
    spec = unison.ClusterSpec({"worker": hosts})
    resolver = unison.SimpleClusterResolver(spec, task_type="worker", task_id=rank)
    options = unison.CommunicationOptions(implementation=implementation, timeout_seconds=30)
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
        "across_hosts": None if not hierarchical else "columns" if transport._column is not None else "leaders",
    }


def train(rank: int, world: int, implementation: str):
    """The multi-worker MLP of test_two_workers_match_single_device, on 4 workers of 2 hosts."""
    strategy = strategy_on_hosts(rank, implementation)
    with strategy.scope():
        model = make_mlp(2, 16)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(x, y):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    for x, y in global_batches():
        strategy.run(step, args=(x.chunk(world)[rank], y.chunk(world)[rank]))
    return {
        "weights": [p.detach().clone() for p in model.parameters()],
        "buckets": strategy.extended.components.gradient_sync.buckets_in_shared_memory,
        "hierarchical": isinstance(strategy.extended.cross_device_ops.transport, HierarchicalTransport),
    }
