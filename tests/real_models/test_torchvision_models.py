"""torchvision's ResNet-18 and ShuffleNetV2 x0.5 (BatchNorm) under unison, against DDP.

Both have BatchNorm: every replica normalises with its own batch's statistics and keeps
its own running statistics, as DDP with ``broadcast_buffers=False`` does. Parameters and
buffers (running mean/var, ``num_batches_tracked``) of every replica are compared.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.real_models import _harness as h

pytestmark = h.requires("torchvision")

STEPS = 4
PER_REPLICA = 4


def resnet18() -> nn.Module:
    return h.import_torchvision().models.resnet18(num_classes=10)


def shufflenet() -> nn.Module:
    return h.import_torchvision().models.shufflenet_v2_x0_5(num_classes=10)


def images(generator: torch.Generator, size: int = 32) -> h.Batch:
    rows = 2 * PER_REPLICA
    return torch.randn(rows, 3, size, size, generator=generator), torch.randint(0, 10, (rows,), generator=generator)


def images_64(generator: torch.Generator) -> h.Batch:
    # ShuffleNetV2 downsamples 32x: at 32x32 its last BatchNorms see 1x1 maps of 4 rows,
    # and a few SGD steps already blow its weights up by 100s; 64x64 trains sanely.
    return images(generator, 64)


def classify(model: nn.Module, batch: h.Batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("strategy_kind", ["mwms", "mirrored"])
def test_resnet18_matches_ddp(worker_pool, strategy_kind):
    diffs = h.run_case(worker_pool, strategy_kind, resnet18, classify, images, STEPS, "resnet18")
    assert diffs["ddp_rank_buffers"] > 1e-3  # per-replica statistics: the buffer comparison means something


@pytest.mark.timeout(90)
@pytest.mark.parametrize("strategy_kind", ["mwms", "mirrored"])
def test_shufflenet_v2_matches_ddp(worker_pool, strategy_kind):
    diffs = h.run_case(worker_pool, strategy_kind, shufflenet, classify, images_64, STEPS, "shufflenet_v2_x0_5")
    assert diffs["ddp_rank_buffers"] > 1e-3
