"""``torch.compile`` on models built in a strategy's scope (in-process strategies).

A compiled model trained with a plain step inside ``strategy.run`` must reach the
parameters of the same model run eagerly under the same strategy and of plain PyTorch
(one device on the global batch; with BatchNorm under MirroredStrategy, a model copy per
replica on its part of the batch, gradients averaged), with no graph break unison causes. Under
MirroredStrategy each replica thread reads its own plain components through the module's
``ReplicaParameters`` (``_interpose/replica_parameters.py``): Dynamo traces that lookup, guards
on the replica id and compiles one graph per replica. Where a read cannot be a plain
tensor (a sync-on-read buffer in replica 0 today, or in cross-replica context) the first
call raises a UsageError that names the way out, instead of AOTAutograd's "Multiple
dispatch failed".

Most cases use ``backend="aot_eager"``: it runs Dynamo and AOTAutograd exactly as inductor
does (the same guards, the same compiled autograd node whose backward feeds the
parameters' AccumulateGrad hooks, where unison's gradient sync lives) and only skips
inductor's C++ code generation, which costs tens of seconds per graph on this machine.
One case runs inductor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters
from torch.nn import functional as F

import unison
from tests._oracles import train_averaged_copies
from unison._values.variables import DistributedVariable
from unison.errors import UsageError

pytestmark = pytest.mark.timeout(120)

STEPS = 4
BATCH = 8


class _MLP(nn.Module):
    """Defined here, not an ``nn.Sequential``: ``Module.compile()`` compiles ``_call_impl``,
    and Dynamo skips frames of torch.nn's own files, so a bare Sequential would run
    uncompiled (plain PyTorch 2.13 does the same)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class _ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                                    nn.Linear(4 * 6 * 6, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return _MLP()


def _conv_bn() -> nn.Module:
    torch.manual_seed(0)
    return _ConvBN()


def _batches(make: Callable[[], nn.Module]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    shape = (BATCH, 8) if make is _mlp else (BATCH, 3, 6, 6)
    return [(torch.randn(*shape, generator=g), torch.randint(0, 4, (BATCH,), generator=g)) for _ in range(STEPS)]


def _state(model: nn.Module) -> list[torch.Tensor]:
    """Parameters (whose replicas must agree) and buffers (every replica's: BatchNorm's
    running statistics are per replica), as plain tensors."""
    out = []
    for tensor in model.parameters():
        if isinstance(tensor, DistributedVariable):
            components = [c.detach() for c in tensor.values]
            for c in components[1:]:
                torch.testing.assert_close(c, components[0], rtol=0, atol=1e-6)
            out.append(components[0].clone())
        else:
            out.append(tensor.detach().clone())
    for tensor in model.buffers():
        components = tensor.values if isinstance(tensor, DistributedVariable) else (tensor,)
        out.extend(c.detach().float().clone() for c in components)
    return out


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert len(a) == len(b)
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def _train(strategy: unison.Strategy | None, make: Callable[[], nn.Module], how: str,
           backend: str = "aot_eager") -> list[torch.Tensor]:
    """Trains ``make()`` for STEPS steps; ``how``: eager, or where it is compiled (after the
    scope, inside it, or with ``Module.compile``)."""
    torch._dynamo.reset()
    counters.clear()
    if strategy is None:
        model = make()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for x, y in _batches(make):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        return _state(model)
    with strategy.scope():
        model = make()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        compiled: Any = torch.compile(model, backend=backend) if how == "inside" else model
    if how == "after":
        compiled = torch.compile(model, backend=backend)
    elif how == "method":
        model.compile(backend=backend)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(compiled(x), y)
        loss.backward()
        opt.step()
        return loss

    n = strategy.num_replicas_in_sync
    for x, y in _batches(make):
        if n > 1:
            x, y = unison.PerReplica(list(x.chunk(n))), unison.PerReplica(list(y.chunk(n)))
        strategy.run(step, args=(x, y))
    return _state(model)


def _plain_replicas(make: Callable[[], nn.Module], replicas: int) -> list[torch.Tensor]:
    """The plain PyTorch oracle for ``replicas`` replicas that keep their own BatchNorm
    statistics: a copy of ``make()`` per replica trains on its part of each batch, the
    copies' gradients averaged before each (identical) SGD step. As ``_state`` returns
    them: the parameters, then every buffer's replicas in replica order."""
    models = [make() for _ in range(replicas)]
    train_averaged_copies(models, _batches(make))
    return ([p.detach().clone() for p in models[0].parameters()]
            + [b.detach().float().clone() for per_replica in zip(*(m.buffers() for m in models)) for b in per_replica])


def _graph_breaks() -> int:
    return sum(counters["graph_break"].values())


STRATEGIES = {
    "one_device": lambda: unison.OneDeviceStrategy("cpu:0"),
    "mirrored": lambda: unison.MirroredStrategy(["cpu:0", "cpu:1"]),
}


@pytest.mark.parametrize("how", ["after", "inside", "method"])
@pytest.mark.parametrize("kind", list(STRATEGIES))
def test_compiled_mlp_trains_as_eager_without_graph_breaks(kind, how):
    eager = _train(STRATEGIES[kind](), _mlp, "eager")
    compiled = _train(STRATEGIES[kind](), _mlp, how)
    breaks = _graph_breaks()
    graphs = counters["stats"]["unique_graphs"]
    assert _max_diff(compiled, eager) <= 1e-5
    assert _max_diff(compiled, _train(None, _mlp, "eager")) <= 1e-5  # and one device on the global batch
    # Before ReplicaParameters spelled out dict.__getitem__, each parameter read in a
    # replica thread was a graph break (4 per step here).
    assert breaks == 0, counters["graph_break"]
    assert graphs == (2 if kind == "mirrored" else 1)  # one graph per replica (its id is guarded)


def test_each_replica_runs_its_own_components():
    """The compiled graph reads the calling replica's components, not the first caller's:
    component 1 is made to differ, and each replica's output must be its own."""
    strategy = unison.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = _mlp()
    with torch.no_grad():
        model.layers[0].weight.values[1].add_(1.0)  # only replica 1's copy
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(4, 8)

    def own(replica: int) -> torch.Tensor:
        w = [p.values[replica] for p in model.parameters()]
        return F.linear(F.relu(F.linear(x, w[0], w[1])), w[2], w[3])

    for _ in range(2):  # the second call runs the cached graphs, chosen by their guards
        out = strategy.run(lambda: compiled(x).detach())
        for replica in (0, 1):
            torch.testing.assert_close(out.values[replica], own(replica), rtol=0, atol=0)
    assert not torch.allclose(own(0), own(1))


def test_conv_batchnorm_one_device_trains_as_eager_and_plain_pytorch():
    eager = _train(STRATEGIES["one_device"](), _conv_bn, "eager")
    compiled = _train(STRATEGIES["one_device"](), _conv_bn, "after")
    assert _graph_breaks() == 0, counters["graph_break"]
    assert _max_diff(compiled, eager) <= 1e-5
    assert _max_diff(compiled, _train(None, _conv_bn, "eager")) <= 1e-5


def test_conv_batchnorm_mirrored_trains_as_eager_and_plain_pytorch():
    """BatchNorm's running statistics are sync-on-read buffers; each replica, replica 0
    included, reads and updates a plain component (component 0 is a plain alias of the
    variable, as a MirroredVariable's is), so AOTAutograd takes them as graph inputs."""
    eager = _train(STRATEGIES["mirrored"](), _conv_bn, "eager")
    strategy = STRATEGIES["mirrored"]()
    with strategy.scope():
        probe = nn.BatchNorm2d(1)
    assert probe.running_mean.component(0) is not probe.running_mean
    compiled = _train(strategy, _conv_bn, "after")
    assert _graph_breaks() == 0, counters["graph_break"]
    assert _max_diff(compiled, eager) <= 1e-5
    assert _max_diff(compiled, _plain_replicas(_conv_bn, 2)) <= 1e-5  # per-replica BatchNorm, mean gradients


def test_cross_replica_call_reads_component_0_or_says_why_not():
    """Outside ``strategy.run`` a compiled mirrored model reads component 0 (as eager reads do);
    a sync-on-read buffer there reads the replicas' aggregate, which is no graph input: a
    clear error instead of AOTAutograd's."""
    strategy = unison.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        mlp, conv = _mlp(), _conv_bn().eval()
    torch._dynamo.reset()
    counters.clear()
    x = torch.randn(4, 8)
    torch.testing.assert_close(torch.compile(mlp, backend="aot_eager")(x), mlp(x), rtol=0, atol=0)
    assert _graph_breaks() == 0, counters["graph_break"]  # was 17 (the variables' __torch_function__ traced)
    with pytest.raises(UsageError, match=r"'running_mean' in cross-replica context .*inside strategy.run"):
        torch.compile(conv, backend="aot_eager")(torch.randn(2, 3, 6, 6))


def test_inductor_mirrored_mlp_trains_as_eager_and_plain_pytorch(monkeypatch):
    """The one inductor case: two replica graphs compiled to C++, the numbers of eager and
    of one device on the global batch."""
    import torch._inductor.config

    # In this process: with a cold cache inductor's pool of compile workers outlives the test.
    monkeypatch.setattr(torch._inductor.config, "compile_threads", 1)
    eager = _train(STRATEGIES["mirrored"](), _mlp, "eager")
    compiled = _train(STRATEGIES["mirrored"](), _mlp, "after", backend="inductor")
    assert _graph_breaks() == 0, counters["graph_break"]
    assert _max_diff(compiled, eager) <= 1e-5
    assert _max_diff(compiled, _train(None, _mlp, "eager")) <= 1e-5
