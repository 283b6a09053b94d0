"""Models, data, a clock every process reads, and the hybrid workers of ``test_table_policies_on_ps.py``
(module level: worker and ps processes import them)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import unison
from tests.ps import _hybrid_workers as hw
from unison import DynamicEmbedding
from unison.embeddings import AdmitAfter, AdmitWithProbability, EvictBelowCount, EvictUnseen

DIM = 4
SKETCH = {"sketch_width": 4096, "sketch_depth": 4}


class FileClock:
    """Monotonic seconds read from a file: a clock that the test moves for every process at once.

    A policy's clock is pickled with it; this one reads the same file on a ps task, a worker
    and the test process, so the test decides when time passes for the rows wherever they live.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)

    def set(self, seconds: float) -> None:
        tmp = Path(self.path + ".tmp")
        tmp.write_text(repr(float(seconds)))
        tmp.replace(self.path)

    def advance(self, seconds: float) -> None:
        self.set(self() + seconds)

    def __call__(self) -> float:
        return float(Path(self.path).read_text())

    def __repr__(self) -> str:
        return f"FileClock({self.path!r})"


def _uniform():
    return unison._embeddings.tables.initializers.uniform(-0.5, 0.5)


class PolicyRanker(nn.Module):
    """One pooled table per policy, each with a linear head of its own: one prediction per table.

    The tables share no parameter, so a table whose rows differ from one device's on
    purpose (a capacity split over ps tasks) leaves the others' training unchanged.
    """

    def __init__(self, clock: FileClock, capacity: int = 10):
        super().__init__()
        self.tables = nn.ModuleDict({
            "admit": DynamicEmbedding(DIM, mode="sum", seed=1, initializer=_uniform(),
                                      admission=AdmitAfter(2, **SKETCH)),
            "draw": DynamicEmbedding(DIM, mode="sum", seed=2, initializer=_uniform(),
                                     admission=AdmitWithProbability(0.4, **SKETCH)),
            "lru": DynamicEmbedding(DIM, mode="sum", seed=3, initializer=_uniform(), capacity=capacity),
            "lfu": DynamicEmbedding(DIM, mode="sum", seed=4, initializer=_uniform(), capacity=capacity,
                                    capacity_policy="lfu", admission=AdmitAfter(2, **SKETCH),
                                    eviction=EvictBelowCount(1)),
            "ttl": DynamicEmbedding(DIM, mode="sum", seed=5, initializer=_uniform(),
                                    eviction=EvictUnseen(4, seconds=5.0, clock=clock)),
        })
        self.heads = nn.ModuleDict({name: nn.Linear(DIM, 1) for name in self.tables})

    def forward(self, ids):
        return torch.stack([self.heads[name](table(ids)).squeeze(1) for name, table in self.tables.items()])


def policy_batches(count: int, seed: int = 0, batch: int = 4, bag: int = 2):
    """Bags from a pool where a few ids are frequent and most are rare (and the int64 extremes)."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.cat([torch.tensor([-2**63, 2**63 - 1, -1, 0]),
                      torch.randint(-2**63, 2**63 - 1, (20,), generator=g, dtype=torch.int64)])
    weights = torch.cat([torch.full((6,), 6.0), torch.ones(18)])
    return [(pool[torch.multinomial(weights, batch * bag, replacement=True, generator=g)].reshape(batch, bag),
             torch.randn(batch, generator=g)) for _ in range(count)]


def train_step(model, optimizer):
    def step(ids, target):
        out = model(ids)
        loss = F.mse_loss(out, target.expand_as(out))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.detach()
    return step


# ---- the hybrid strategy ----------------------------------------------------------------------

class HybridPolicyRanker(nn.Module):
    """Three tables, one column of ids each: admission, a capacity, a time to live in seconds; a dense tower."""

    def __init__(self, clock: FileClock, capacity: int):
        super().__init__()
        self.admit = DynamicEmbedding(DIM, mode="sum", seed=6, initializer=_uniform(),
                                      admission=AdmitAfter(2, **SKETCH))
        self.cap = DynamicEmbedding(DIM, mode="sum", seed=7, initializer=_uniform(), capacity=capacity)
        self.ttl = DynamicEmbedding(DIM, mode="sum", seed=8, initializer=_uniform(),
                                    eviction=EvictUnseen(seconds=5.0, clock=clock))
        self.dense = nn.Linear(3, DIM)
        self.head = nn.Linear(DIM, 1)

    def forward(self, ids, features):
        rows = self.admit(ids[:, 0:1]) + self.cap(ids[:, 1:2]) + self.ttl(ids[:, 2:3])
        return self.head(torch.relu(rows + self.dense(features))).squeeze(1)


def hybrid_batches(steps: int, workers: int, per_worker: int = 4, seed: int = 0):
    """Global batches; worker ``r`` takes samples ``r::workers`` and only ids of its own: returning ids
    from a pool of its own for admission and the time to live, ids never seen before for the capacity."""
    g = torch.Generator().manual_seed(seed)
    pools = [torch.randint(-2**63, 2**63 - 1, (2, 6), generator=g, dtype=torch.int64) for _ in range(workers)]
    out = []
    for step in range(steps):
        n = per_worker * workers
        owner = torch.arange(n) % workers
        columns = []
        for i, o in enumerate(owner.tolist()):
            fresh = 10**6 * (step + 1) + i  # sample i of step `step`: a new id (its worker owns sample i)
            picks = torch.randint(0, 6, (2,), generator=g)
            columns.append(torch.tensor([int(pools[o][0, picks[0]]), fresh, int(pools[o][1, picks[1]])]))
        out.append((torch.stack(columns), torch.randn(n, 3, generator=g), torch.randn(n, generator=g)))
    return out


SECONDS_PER_STEP = 2.0


def hybrid_optimizers(model: HybridPolicyRanker, optimizer: str) -> list[torch.optim.Optimizer]:
    """Adagrad for all; or SparseAdam (Adam for the dense tower), or Ftrl (Adagrad for it) on the rows."""
    if optimizer == "adagrad":
        return [torch.optim.Adagrad(model.parameters(), lr=0.2)]
    rows = [*model.admit.parameters(), *model.cap.parameters(), *model.ttl.parameters()]
    dense = [*model.dense.parameters(), *model.head.parameters()]
    if optimizer == "sparse_adam":
        return [torch.optim.SparseAdam(rows, lr=0.05), torch.optim.Adam(dense, lr=0.05)]
    return [unison.optim.Ftrl(rows, lr=0.2, l1=0.001), torch.optim.Adagrad(dense, lr=0.2)]


def hybrid_reference(steps: int, world: int, clock_path: str, capacity: int, optimizer: str = "adagrad"):
    """One device on the global batches, its clock moving as the workers move theirs."""
    clock = FileClock(clock_path)
    clock.set(100.0)
    torch.manual_seed(0)
    model = HybridPolicyRanker(clock, capacity)
    opts = hybrid_optimizers(model, optimizer)
    for ids, features, target in hybrid_batches(steps, world):
        loss = F.mse_loss(model(ids, features), target)
        for opt in opts:
            opt.zero_grad()
        loss.backward()
        for opt in opts:
            opt.step()
        clock.advance(SECONDS_PER_STEP)
    return model.state_dict()


def hybrid_train(rank: int, world: int, ps: list[str], key_hex: str, steps: int, clock_path: str, capacity: int,
                 optimizer: str = "adagrad"):
    """Trains this worker's share; after every step all pushes land, then worker 0 moves the clock."""
    strategy = hw.strategy_for(rank, world, ps, key_hex)
    clock = FileClock(clock_path)
    barrier = strategy.extended.components.cross_device_ops.barrier
    torch.manual_seed(0)
    with strategy.scope():
        model = HybridPolicyRanker(clock, capacity)
        opts = hybrid_optimizers(model, optimizer)
    for ids, features, target in hybrid_batches(steps, world):
        mine = slice(rank, None, world)
        loss = F.mse_loss(model(ids[mine], features[mine]), target[mine])
        for opt in opts:
            opt.zero_grad()
        loss.backward()
        for opt in opts:
            opt.step()
        strategy.join_pushes()
        barrier()  # every push of this step is on the ps task...
        if rank == 0:
            clock.advance(SECONDS_PER_STEP)
        barrier()  # ...before time moves and the next step reads the clock
    state = model.state_dict()
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
