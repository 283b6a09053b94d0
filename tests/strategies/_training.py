"""A small MLP trained under a strategy and as plain PyTorch on the same global batches."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import unison

IN, HIDDEN, OUT = 12, 24, 5
GLOBAL_BATCH = 64
STEPS = 20


def make_mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))


def batches(steps: int = STEPS, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(GLOBAL_BATCH, IN, generator=gen), torch.randn(GLOBAL_BATCH, OUT, generator=gen))
            for _ in range(steps)]


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)


MakeOpt = Callable[[Any], torch.optim.Optimizer]
MakeSched = Callable[[torch.optim.Optimizer], Any]


def train_plain(make_opt: MakeOpt, make_sched: MakeSched | None = None, data=None) -> nn.Module:
    model = make_mlp()
    opt = make_opt(model.parameters())
    sched = make_sched(opt) if make_sched else None
    for x, y in (batches() if data is None else data):
        opt.zero_grad()
        loss_fn(model, x, y).backward()
        opt.step()
        if sched:
            sched.step()
    return model


def split(strategy: unison.Strategy, t: torch.Tensor) -> Any:
    """The global batch split evenly over the replicas, as the input pipeline would."""
    n = strategy.num_replicas_in_sync
    return t if n == 1 else unison.PerReplica(list(t.chunk(n)))


def train_strategy(strategy: unison.Strategy, make_opt: MakeOpt, make_sched: MakeSched | None = None,
                   data=None) -> tuple[nn.Module, torch.optim.Optimizer]:
    with strategy.scope():
        model = make_mlp()
        opt = make_opt(model.parameters())
    sched = make_sched(opt) if make_sched else None

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = loss_fn(model, x, y)
        loss.backward()
        opt.step()
        return loss

    for x, y in (batches() if data is None else data):
        strategy.run(step, args=(split(strategy, x), split(strategy, y)))
        if sched:
            sched.step()
    return model, opt


def components(strategy: unison.Strategy, param: torch.Tensor) -> tuple[torch.Tensor, ...]:
    if isinstance(param, unison.DistributedValues):
        return tuple(c.detach() for c in strategy.experimental_local_results(param))
    return (param.detach(),)


def max_abs_diff(strategy: unison.Strategy, model: nn.Module, reference: nn.Module) -> float:
    """Largest difference between any replica's weights and the reference's."""
    diffs = [
        (c - r.detach()).abs().max().item()
        for p, r in zip(model.parameters(), reference.parameters(), strict=True)
        for c in components(strategy, p)
    ]
    return max(diffs)


def replicas_identical(strategy: unison.Strategy, model: nn.Module) -> bool:
    return all(
        all(torch.equal(c, cs[0]) for c in cs)
        for cs in (components(strategy, p) for p in model.parameters())
    )


def assert_trains_as_on_one_device(strategy: unison.Strategy, make: Callable[[], nn.Module], x: torch.Tensor, *,
                                   convert: Callable[[nn.Module], Any] | None = None, steps: int = 3,
                                   atol: float = 1e-6) -> nn.Module:
    """Trains ``make()`` built in ``strategy``'s scope (the replicas split ``x``) and a plain
    ``make()`` on all of ``x`` (SGD on summed squares, divided by the replicas as their mean
    is): every component of every parameter must equal the plain model's. ``make`` seeds
    itself; ``convert`` runs on both models after they are built (``lambda m: m.double()``).
    Returns the strategy's model."""
    reference = make()
    with strategy.scope():
        model = make()
    if convert is not None:
        convert(reference)
        convert(model)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)

    def step(batch: torch.Tensor) -> None:
        opt.zero_grad()
        model(batch).pow(2).sum().backward()
        opt.step()

    for _ in range(steps):
        ref_opt.zero_grad()
        (reference(x).pow(2).sum() / strategy.num_replicas_in_sync).backward()
        ref_opt.step()
        strategy.run(step, args=(split(strategy, x),))
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        for component in components(strategy, mine):
            torch.testing.assert_close(component, theirs.detach(), rtol=0, atol=atol)
    return model
