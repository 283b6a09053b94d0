"""Module buffers under several local replicas: one copy per replica, averaged on read."""

from __future__ import annotations

import torch
from torch import nn

import unison


def test_batchnorm_statistics_are_per_replica_and_read_as_their_mean():
    torch.manual_seed(0)
    x = torch.randn(32, 4) * 3 + 1
    strategy = unison.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        bn = nn.BatchNorm1d(4)
    assert isinstance(bn.running_mean, unison.SyncOnReadVariable)
    strategy.run(lambda v: bn(v), args=(unison.PerReplica([x[:16], x[16:]]),))

    first, second = (nn.BatchNorm1d(4), nn.BatchNorm1d(4))
    first(x[:16])
    second(x[16:])
    assert torch.allclose(bn.running_mean.values[0], first.running_mean)
    assert torch.allclose(bn.running_mean.values[1], second.running_mean)
    saved = bn.state_dict()
    assert type(saved["running_mean"]) is torch.Tensor
    assert torch.allclose(saved["running_mean"], (first.running_mean + second.running_mean) / 2)
    assert int(saved["num_batches_tracked"]) == 1


def test_one_device_buffers_stay_plain_tensors():
    with unison.OneDeviceStrategy("cpu:0").scope():
        bn = nn.BatchNorm1d(3)
    assert type(bn.running_mean) is torch.Tensor
