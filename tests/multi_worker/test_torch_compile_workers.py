"""``torch.compile`` under MultiWorkerMirroredStrategy (2 workers of the warm pool).

With one device per worker the parameters are plain tensors, so Dynamo sees a plain
module (no graph break); gradients are all-reduced from ``register_post_accumulate_grad_hook``
hooks (``_gradient_sync/bucketed/buckets.py``). AOTAutograd runs the compiled region's backward as one
autograd node, and the parameters' AccumulateGrad nodes (with their hooks) still run one by
one after it: these tests check that every hook fires, that every bucket is launched from
them before the end-of-backward callback (flat gloo), and that the compiled model trains
exactly as the eager one on the same shards, and as plain PyTorch (one device on the
global batch; with BatchNorm, a model copy per worker on its shard, gradients averaged).
They run ``backend="aot_eager"``: the same Dynamo guards and AOTAutograd backward node as
inductor, without its C++ compile time.

What the hooks cannot give a compiled model is overlap: the gradients all appear when the
compiled backward node ends, so no bucket leaves while backward still computes (DDP's
DDPOptimizer splits the graph at bucket boundaries for that). ``benchmarks/compile_step.py``
measures the step time.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import unison
from tests._oracles import train_averaged_copies

pytestmark = pytest.mark.timeout(120)

ADDRESSES = ["127.0.0.1:1", "127.0.0.1:2"]  # never bound: the pool's process group is used
STEPS = 4


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class _ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                                    nn.Linear(4 * 6 * 6, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _make(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return _MLP() if kind == "mlp" else _ConvBN()


def _batches(kind: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    shape = (8, 8) if kind == "mlp" else (8, 3, 6, 6)
    return [(torch.randn(*shape, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(STEPS)]


def _state(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach().float().clone() for t in [*model.parameters(), *model.buffers()]]


def _train_here(rank: int, world: int, kind: str, implementation: str, compiled: bool) -> dict[str, Any]:
    """One MWMS run on this worker's shards; counts the parameters' hooks and the buckets
    launched before the end-of-backward callback in the last step."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    resolver = unison.SimpleClusterResolver(unison.ClusterSpec({"worker": ADDRESSES[:world]}),
                                            task_type="worker", task_id=rank)
    options = unison.CommunicationOptions(bytes_per_pack=256, implementation=implementation)  # several buckets
    strategy = unison.MultiWorkerMirroredStrategy(resolver, options)
    with strategy.scope():
        model = _make(kind)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    forward = torch.compile(model, backend="aot_eager") if compiled else model
    sync = strategy.extended.components.gradient_sync
    events: list[str] = []
    launch, finish = sync._launch, sync._finish  # instrumentation of this run only

    def counting_launch(bucket: Any) -> None:
        events.append("launch")
        launch(bucket)

    def counting_finish() -> None:
        events.append("finish")
        finish()

    sync._launch, sync._finish = counting_launch, counting_finish
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: events.append("grad"))

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        events.clear()
        opt.zero_grad()
        loss = F.cross_entropy(forward(x), y)
        loss.backward()
        opt.step()
        return loss

    for x, y in _batches(kind):
        strategy.run(step, args=(x.chunk(world)[rank], y.chunk(world)[rank]))
    end = events.index("finish")
    return {"state": _state(model), "grads": events.count("grad"), "launched_in_hooks": events[:end].count("launch"),
            "buckets": len(sync._buckets), "graph_breaks": sum(counters["graph_break"].values()),
            "graphs": counters["stats"]["unique_graphs"]}


def _eager_and_compiled(rank: int, world: int, kind: str, implementation: str) -> tuple[dict, dict]:
    return (_train_here(rank, world, kind, implementation, compiled=False),
            _train_here(rank, world, kind, implementation, compiled=True))


def _one_device_mlp() -> list[torch.Tensor]:
    model = _make("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in _batches("mlp"):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return _state(model)


def _plain_workers(kind: str, world: int) -> list[list[torch.Tensor]]:
    """The plain PyTorch oracle for workers that keep their own BatchNorm statistics: a copy
    of the model per worker trains on its shard of each batch, the copies' gradients
    averaged before each (identical) SGD step. Each worker's ``_state``."""
    models = [_make(kind) for _ in range(world)]
    train_averaged_copies(models, _batches(kind))
    return [_state(m) for m in models]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert len(a) == len(b)
    return max((x - y).abs().max().item() for x, y in zip(a, b))


@pytest.mark.parametrize("implementation", ["RING", "AUTO"])  # flat gloo from the hooks; one host's shared memory
def test_compiled_mlp_trains_as_eager_with_every_hook(worker_pool, implementation):
    results = worker_pool.run(_eager_and_compiled, "mlp", implementation, timeout=90)
    single = _one_device_mlp()
    for eager, compiled in results:
        assert _max_diff(compiled["state"], eager["state"]) <= 1e-5
        assert _max_diff(compiled["state"], single) <= 1e-5
        assert compiled["graph_breaks"] == 0 and compiled["graphs"] == 1
        assert compiled["grads"] == eager["grads"] == 6  # every parameter's hook, through the compiled backward
        if implementation == "RING":  # buckets leave from the hooks, before backward's end callback
            assert compiled["buckets"] >= 3  # (the layouts may differ: each follows its own backward's order)
            assert compiled["launched_in_hooks"] == compiled["buckets"]
            assert eager["launched_in_hooks"] == eager["buckets"]


def test_compiled_conv_batchnorm_trains_as_eager_and_plain_pytorch(worker_pool):
    results = worker_pool.run(_eager_and_compiled, "conv", "AUTO", timeout=90)
    plain = _plain_workers("conv", len(results))
    for (eager, compiled), want in zip(results, plain):
        assert _max_diff(compiled["state"], eager["state"]) <= 1e-5
        assert _max_diff(compiled["state"], want) <= 1e-5  # per-worker BatchNorm, mean gradients
        assert compiled["graph_breaks"] == 0
        assert compiled["grads"] == eager["grads"] == 6
    assert _max_diff(results[0][1]["state"], results[1][1]["state"]) > 1e-4  # per-worker BN statistics differ


def _split_backend(rank: int, world: int, implementation: str) -> dict[str, Any]:
    """``strategy.extended.compile_backend``: over flat gloo it splits the graph at the
    bucket size (DDPOptimizer), so a piece's gradients reach their hooks, and their bucket
    leaves, while the earlier pieces' backward still runs; over one host's shared memory
    (every bucket reduced when backward ends) it is the backend itself."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    resolver = unison.SimpleClusterResolver(unison.ClusterSpec({"worker": ADDRESSES[:world]}),
                                            task_type="worker", task_id=rank)
    options = unison.CommunicationOptions(bytes_per_pack=256, implementation=implementation)
    strategy = unison.MultiWorkerMirroredStrategy(resolver, options)
    with strategy.scope():
        model = _make("mlp")
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    backend = strategy.extended.compile_backend("aot_eager")
    forward = torch.compile(model, backend=backend)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        F.cross_entropy(forward(x), y).backward()
        opt.step()

    for x, y in _batches("mlp"):
        strategy.run(step, args=(x.chunk(world)[rank], y.chunk(world)[rank]))
    split = backend != "aot_eager"
    pieces = len(backend.__self__.buckets) if split else 1  # DDPOptimizer keeps the buckets it split at
    return {"state": _state(model), "split": split, "pieces": pieces, "graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values())}


@pytest.mark.parametrize("implementation", ["RING", "AUTO"])
def test_the_compile_backend_splits_at_buckets_where_they_overlap_backward(worker_pool, implementation):
    single = _one_device_mlp()
    for result in worker_pool.run(_split_backend, implementation, timeout=90):
        assert _max_diff(result["state"], single) <= 1e-5
        assert result["graph_breaks"] == 0
        assert result["graphs"] == 1  # one Dynamo graph, compiled in pieces
        if implementation == "RING":  # buckets leave during backward: the graph is split at the bucket size
            assert result["split"] and result["pieces"] >= 2
        else:  # shared memory reduces every bucket at the end of backward: nothing to split for
            assert not result["split"] and result["pieces"] == 1
