"""A parameter made by any route joins MultiWorkerMirroredStrategy (2 workers, warm pool).

Under one device per worker the parameters stay plain tensors that carry the workers'
gradient synchroniser. A deep copy used to drop it: the workers' copies of a 2-layer
TransformerEncoder (whose layers are deep copies) parted by 2e-2 within two steps,
silently, since their gradients were never all-reduced. Each route here must end equal
on both workers and equal to one device on the global batch, or be refused at its first
step.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import unison

pytestmark = pytest.mark.timeout(120)

ADDRESSES = ["127.0.0.1:1", "127.0.0.1:2"]  # never bound: the pool's gloo group is reused
VOCAB, WIDTH, STEPS = 40, 16, 4


def _language_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(WIDTH, 2, 32, dropout=0.0, batch_first=True)
    return nn.ModuleDict({"embed": nn.Embedding(VOCAB, WIDTH),
                          "encoder": nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
                          "head": nn.Linear(WIDTH, VOCAB)})


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (8, 7), generator=g) for _ in range(STEPS)]


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model["head"](model["encoder"](model["embed"](tokens[:, :-1])))
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def _train(model: nn.Module, shard, strategy=None) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)

    def step(tokens: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = _loss(model, tokens)
        loss.backward()
        opt.step()
        return loss

    for tokens in _batches():
        if strategy is None:
            step(tokens)
        else:
            strategy.run(step, args=(shard(tokens),))
    return [p.detach().clone() for p in model.parameters()]


def _route(rank: int, world: int, route: str):
    """Pool function: builds the LM in scope, applies ``route``, trains on this worker's shard."""
    resolver = unison.SimpleClusterResolver(unison.ClusterSpec({"worker": ADDRESSES[:world]}),
                                            task_type="worker", task_id=rank)
    strategy = unison.MultiWorkerMirroredStrategy(resolver)
    with strategy.scope():
        model = _language_model()  # nn.TransformerEncoder deep-copies its layer here
        if route == "copy_in_scope":
            model = copy.deepcopy(model)
    if route == "copy_outside":
        model = copy.deepcopy(model)
    elif route == "assign":
        checkpoint = {k: v.clone() for k, v in _language_model(seed=7).state_dict().items()}
        model.load_state_dict(checkpoint, assign=True)
    elif route == "added_outside":
        model["head"].register_parameter("offset", nn.Parameter(torch.zeros(VOCAB)))
    try:
        return _train(model, lambda t: t.chunk(world)[rank], strategy)
    except unison.errors.UsageError as e:
        return str(e)


@pytest.mark.parametrize("route", ["built_in_scope", "copy_in_scope", "copy_outside", "assign"])
def test_parameters_made_by_every_route_are_all_reduced(worker_pool, route):
    reference = _language_model(seed=7 if route == "assign" else 0)
    want = _train(reference, None)
    got = worker_pool.run(_route, route, timeout=90)
    for weights in got:
        assert len(weights) == len(want)
        for mine, theirs in zip(weights, want):
            torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)
    for mine, theirs in zip(*got):
        assert torch.equal(mine, theirs)  # the workers agree exactly


def test_a_parameter_added_outside_the_scope_is_refused_on_every_worker(worker_pool):
    for message in worker_pool.run(_route, "added_outside", timeout=90):
        assert isinstance(message, str) and "not synchronised by the strategy of the optimizer's first" in message


def _averaged_copy(rank: int, world: int):
    """An AveragedModel (a deep copy never differentiated) beside training: its parameters
    join the strategy but stay out of the buckets, so no step all-reduces their zeros."""
    from torch.optim.swa_utils import AveragedModel

    resolver = unison.SimpleClusterResolver(unison.ClusterSpec({"worker": ADDRESSES[:world]}),
                                            task_type="worker", task_id=rank)
    strategy = unison.MultiWorkerMirroredStrategy(resolver)
    with strategy.scope():
        model = _language_model()
    sync = strategy.extended.components.gradient_sync
    bucketed = sync.parameters_in_buckets
    average = AveragedModel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)

    def step(tokens: torch.Tensor) -> None:
        opt.zero_grad()
        _loss(model, tokens).backward()
        opt.step()
        average.update_parameters(model)

    for tokens in _batches():
        strategy.run(step, args=(tokens.chunk(world)[rank],))
    return bucketed, sync.parameters_in_buckets, [p.detach().clone() for p in average.module.parameters()]


def test_an_averaged_model_copy_stays_out_of_the_buckets(worker_pool):
    (before, after, average), (_, _, other) = worker_pool.run(_averaged_copy, timeout=90)
    assert after == before > 0
    for mine, theirs in zip(average, other):
        assert torch.equal(mine, theirs)


def _save_whole_model(rank: int, world: int):
    import io

    resolver = unison.SimpleClusterResolver(unison.ClusterSpec({"worker": ADDRESSES[:world]}),
                                            task_type="worker", task_id=rank)
    strategy = unison.MultiWorkerMirroredStrategy(resolver)
    with strategy.scope():
        model = _language_model()
    buffer = io.BytesIO()
    torch.save(model, buffer)  # the parameters carried their synchroniser (a process group) before
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    return all(torch.equal(a, b) for a, b in zip(loaded.parameters(), model.parameters()))


def test_a_whole_model_pickles_under_multi_worker_mirrored(worker_pool):
    # torch.save(model) raised "cannot pickle 'ProcessGroup' object": each parameter's
    # __dict__ held the gradient synchroniser, which torch pickles with the parameter.
    assert worker_pool.run(_save_whole_model, timeout=60) == [True, True]
