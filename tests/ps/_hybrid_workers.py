"""Worker functions of the hybrid strategy's tests (module level: worker processes import them)."""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.nn.functional as F
from torch import nn

import unison
from unison import DynamicEmbedding

DIM = 4


class Ranker(nn.Module):
    """Pooled dynamic rows and a dense tower: the shape of a ranking model."""

    def __init__(self):
        super().__init__()
        self.rows = DynamicEmbedding(DIM, mode="sum", seed=5,
                                     initializer=unison._embeddings.tables.initializers.uniform(-0.5, 0.5))
        self.dense = nn.Linear(3, DIM)
        self.head = nn.Linear(DIM, 1)

    def forward(self, ids, features):
        return self.head(torch.relu(self.rows(ids) + self.dense(features))).squeeze(1)


def global_batches(steps: int, workers: int, per_worker: int = 4, seed: int = 0, shared: bool = False):
    """Per step: ids, features, targets of the global batch; worker ``r`` takes rows ``r::workers``,
    and its ids come from a pool of its own (no row is pushed by two workers), or with ``shared``
    from one pool (a row is pushed by several workers in the same step)."""
    g = torch.Generator().manual_seed(seed)
    pools = [torch.randint(-2**63, 2**63 - 1, (12,), generator=g, dtype=torch.int64) for _ in range(workers)]
    out = []
    for _ in range(steps):
        n = per_worker * workers
        owner = torch.zeros(n, dtype=torch.int64) if shared else torch.arange(n) % workers
        ids = torch.stack([pools[int(o)][torch.randint(0, 12, (3,), generator=g)] for o in owner])
        out.append((ids, torch.randn(n, 3, generator=g), torch.randn(n, generator=g)))
    return out


def strategy_for(rank: int, world: int, ps: list[str], key_hex: str, timeout: float = 20.0):
    spec = unison.ClusterSpec({"worker": [f"127.0.0.1:{i + 1}" for i in range(world)], "ps": ps})
    options = unison.CommunicationOptions(timeout_seconds=30)
    return unison.HybridParameterServerStrategy(unison.SimpleClusterResolver(spec, task_type="worker", task_id=rank),
                                                options, devices=["cpu:0"], authkey=bytes.fromhex(key_hex),
                                                timeout_seconds=timeout)


def _build(strategy):
    torch.manual_seed(0)
    with strategy.scope():
        model = Ranker()
        opt = torch.optim.Adagrad(model.parameters(), lr=0.2)
    return model, opt


def train(rank: int, world: int, ps: list[str], key_hex: str, steps: int, shared: bool = False):
    """Trains on this worker's share; returns the dense parameters after every step and the table."""
    strategy = strategy_for(rank, world, ps, key_hex)
    model, opt = _build(strategy)
    dense_after = []
    for ids, features, target in global_batches(steps, world, shared=shared):
        mine = slice(rank, None, world)
        loss = F.mse_loss(model(ids[mine], features[mine]), target[mine])
        opt.zero_grad()
        loss.backward()
        opt.step()
        dense_after.append([p.detach().clone() for name, p in model.named_parameters() if not name.startswith("rows")])
    strategy.join_pushes()  # every worker's last push has landed
    state = model.state_dict()
    return dense_after, {k: v for k, v in state.items() if not isinstance(v, dict)}, model.rows.table_stats()


def rejoin(rank: int, world: int, ps: list[str], key_hex: str):
    """A restarted job: the same model finds the rows the first one trained on the ps tasks."""
    strategy = strategy_for(rank, world, ps, key_hex)
    model, _ = _build(strategy)
    return model.rows.state_dict()["ids"], model.rows.state_dict()["rows"]


def lose_a_ps(rank: int, world: int, ps: list[str], key_hex: str, ps1_pid: int):
    """One step, then ps:1 is killed: the next step fails on every worker, naming it."""
    strategy = strategy_for(rank, world, ps, key_hex, timeout=5.0)
    model, opt = _build(strategy)
    batches = global_batches(2, world)

    def step(ids, features, target):
        mine = slice(rank, None, world)
        loss = F.mse_loss(model(ids[mine], features[mine]), target[mine])
        opt.zero_grad()
        loss.backward()
        opt.step()

    step(*batches[0])
    strategy.join_pushes()  # the first step is on both ps tasks
    if rank == 0:
        os.kill(ps1_pid, signal.SIGKILL)
    strategy.extended.components.cross_device_ops.barrier()
    try:
        step(*batches[1])
    except unison.errors.ParameterServerError as e:
        return str(e)
    return "no error"


def _fixed_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.ModuleDict({"table": nn.EmbeddingBag(64, DIM, mode="sum"), "head": nn.Linear(DIM, 1)})


def fixed_batches(steps: int, workers: int, per_worker: int = 4, seed: int = 3):
    """Ids in [0, 64): worker ``r`` uses ids ``r, r + workers, ...`` only (no row pushed by two)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        n = per_worker * workers
        owner = (torch.arange(n) % workers).unsqueeze(1)
        ids = torch.randint(0, 64 // workers, (n, 3), generator=g) * workers + owner
        out.append((ids, torch.randn(n, generator=g)))
    return out


def train_fixed(rank: int, world: int, ps: list[str], key_hex: str, steps: int):
    """An nn.EmbeddingBag selected by size goes to the ps tasks; each worker seeds differently."""
    strategy = strategy_for(rank, world, ps, key_hex)
    with strategy.scope():
        model = _fixed_model(10 + rank)  # the chief's values must win, for the table as for the head
        moved = unison.embeddings.tables_on_ps(model, min_bytes=64 * DIM * 4)
        opt = torch.optim.Adagrad(model.parameters(), lr=0.2)
    for ids, target in fixed_batches(steps, world):
        mine = slice(rank, None, world)
        loss = F.mse_loss(model["head"](model["table"](ids[mine])).squeeze(1), target[mine])
        opt.zero_grad()
        loss.backward()
        opt.step()
    strategy.join_pushes()
    state = model.state_dict()
    return moved, {k: v for k, v in state.items() if not isinstance(v, dict)}


def skip_a_push(rank: int, world: int, ps: list[str], key_hex: str):
    """Worker 1 computes step 2's gradients but never steps (no push of step 2): worker 0's pull of
    step 3 waits for it, then fails naming the step; worker 1 stays until then."""
    strategy = strategy_for(rank, world, ps, key_hex, timeout=2.5)
    model, opt = _build(strategy)
    batches = global_batches(3, world, shared=True)
    mine = slice(rank, None, world)

    def backward(ids, features, target):
        loss = F.mse_loss(model(ids[mine], features[mine]), target[mine])
        opt.zero_grad()
        loss.backward()

    backward(*batches[0])
    opt.step()
    backward(*batches[1])  # the dense all-reduce of step 2: both workers are here
    if rank == 1:
        time.sleep(4.5)  # alive, its connections open: only its push is missing
        return "skipped"
    opt.step()
    try:
        backward(*batches[2])
    except TimeoutError as e:
        return str(e)
    return "no error"
