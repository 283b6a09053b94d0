"""Gradients that live in the shared file (one host), end to end: two warm pool workers.

Under ``MultiWorkerMirroredStrategy`` on one host a bucket's sums come back into this
worker's part of the shared file, its home (``shared_buckets._Homes``): a bucket of many
small gradients keeps them there from the second step on, and a few large gradients are
handed out as views of it. Models of each kind (24 gradients of 200 KB in all; 4 of 130
KB) are trained there and under DDP on the same shards in the same pool call
(``zero_grad`` to None, and zeroed in place); with the user keeping every step's
gradients (the tensors themselves, or views that hold their memory) the bucket leaves
its home and what the user keeps never changes.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

import unison

pytestmark = pytest.mark.timeout(90)

ADDRESSES = ["127.0.0.1:1", "127.0.0.1:2"]  # never bound: the pool's gloo group is reused
STEPS = 5
SHAPES = {"many_small": (12, 64), "few_large": (2, 128)}
"""(layers, width): 24 gradients (more than 16: flat slots) of 200 KB, or 4 of 130 KB; both
above ONE_SHOT_BYTES, so summed in slices."""


def _model(kind: str) -> nn.Module:
    layers, width = SHAPES[kind]
    torch.manual_seed(0)
    return nn.Sequential(*[layer for _ in range(layers) for layer in (nn.Linear(width, width), nn.Tanh())])


def _train(rank: int, world: int, kind: str, keep: str, set_to_none: bool) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    width = SHAPES[kind][1]
    g = torch.Generator().manual_seed(7)
    batches = [(torch.randn(8, width, generator=g), torch.randn(8, width, generator=g)) for _ in range(STEPS)]
    shards = [(x.chunk(world)[rank], y.chunk(world)[rank]) for x, y in batches]

    def train(model: nn.Module, forward: nn.Module, kept: list | None = None) -> None:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for x, y in shards:
            opt.zero_grad(set_to_none=set_to_none)
            nn.functional.mse_loss(forward(x), y).backward()
            opt.step()
            if kept is not None:
                kept.append([(p.grad if keep == "tensors" else p.grad.detach().view(-1), p.grad.clone())
                             for p in model.parameters()])

    model = _model(kind)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        ddp = DistributedDataParallel(model, broadcast_buffers=False)
    train(model, ddp)
    del ddp
    expected = [p.detach().clone() for p in model.parameters()]
    resolver = unison.SimpleClusterResolver(unison.ClusterSpec({"worker": ADDRESSES[:world]}),
                                            task_type="worker", task_id=rank)
    strategy = unison.MultiWorkerMirroredStrategy(resolver)
    with strategy.scope():
        model = _model(kind)
    kept: list = []
    train(model, model, kept if keep != "nothing" else None)
    sync = strategy.extended.components.gradient_sync
    (bucket,) = sync._buckets
    grads_in_file = [p.grad.untyped_storage().data_ptr() == bucket.flat.untyped_storage().data_ptr()
                     for p in model.parameters()]
    return {
        "largest_difference": max(float((p - q).abs().max()) for p, q in zip(model.parameters(), expected)),
        "moved": max(float((p - q).abs().max()) for p, q in zip(_model(kind).parameters(), expected)),
        "at_home": bucket.home is not None,
        "grads_in_file": all(grads_in_file),
        "kept_unchanged": all(torch.equal(held.reshape(value.shape), value) for step in kept for held, value in step),
        "kept": len(kept),
    }


@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zeroed_in_place"])
@pytest.mark.parametrize("kind", sorted(SHAPES))
def test_gradients_live_in_the_shared_file_and_train_as_ddp(worker_pool, kind, set_to_none):
    for result in worker_pool.run(_train, kind, "nothing", set_to_none, timeout=60):
        assert result["moved"] > 1e-3  # training moved the weights
        assert result["largest_difference"] <= 1e-6
        assert result["at_home"] and result["grads_in_file"]


@pytest.mark.parametrize("keep", ["tensors", "views"])
@pytest.mark.parametrize("kind", sorted(SHAPES))
def test_gradients_the_user_keeps_never_change_and_training_still_equals_ddp(worker_pool, kind, keep):
    """Kept from every step: the bucket leaves its home at the next backward (slots of its
    own, or its spare), so nothing it kept is written again."""
    for result in worker_pool.run(_train, kind, keep, True, timeout=60):
        assert result["kept"] == STEPS and result["kept_unchanged"]
        assert result["largest_difference"] <= 1e-6
        assert not result["at_home"] and not result["grads_in_file"]
