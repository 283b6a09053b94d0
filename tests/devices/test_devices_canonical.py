"""Device names: canonical forms, malformed and duplicate devices."""

from __future__ import annotations

import pytest
import torch

import unison
from unison._devices import canonicalize, canonicalize_all, torch_device


@pytest.mark.parametrize(
    ("name", "canonical"),
    [
        ("/device:GPU:0", "cuda:0"),
        ("GPU:0", "cuda:0"),
        ("gpu:3", "cuda:3"),
        ("/cpu:0", "cpu:0"),
        ("cuda:0", "cuda:0"),
        ("cpu:1", "cpu:1"),
        ("CPU:2", "cpu:2"),
        ("cpu", "cpu:0"),
        ("cuda", "cuda:0"),
        ("/job:worker/replica:0/task:1/device:CPU:0", "cpu:0"),
        (" cpu:1 ", "cpu:1"),
        (torch.device("cpu"), "cpu:0"),
        (torch.device("cuda", 1), "cuda:1"),
    ],
)
def test_canonicalize(name, canonical):
    assert canonicalize(name) == canonical


def test_logical_cpu_devices_map_to_host():
    assert torch_device("cpu:3") == torch.device("cpu")
    assert torch_device("cuda:1") == torch.device("cuda", 1)


def test_strategy_devices_are_canonical():
    strategy = unison.MirroredStrategy(["/device:CPU:0", "CPU:1", "cpu:2"])
    assert strategy.extended.worker_devices == ("cpu:0", "cpu:1", "cpu:2")
    assert strategy.num_replicas_in_sync == 3
    assert unison.OneDeviceStrategy("/cpu:0").extended.worker_devices == ("cpu:0",)


@pytest.mark.parametrize("bad", ["tpu:0", "banana", "cpu:-1", "cpu:x", "gpu0", "", "/device:", "cpu:0:1"])
def test_malformed_device_raises(bad):
    with pytest.raises(ValueError, match=rf"device {bad!r} is not a device name: use 'cpu:K' or 'cuda:K'"):
        unison.MirroredStrategy(["cpu:0", bad])
    with pytest.raises(ValueError, match="is not a device name"):
        unison.OneDeviceStrategy(bad)


@pytest.mark.parametrize("bad", [3, None, 1.5])
def test_device_of_wrong_type_raises(bad):
    with pytest.raises(TypeError, match=r"device must be a str or torch.device, got \w+"):
        unison.OneDeviceStrategy(bad)


@pytest.mark.parametrize(
    "devices",
    [["cpu:0", "cpu:0"], ["cpu:0", "/cpu:0"], ["cpu:1", "CPU:1"], ["cpu", "cpu:0"]],
)
def test_duplicate_devices_raise(devices):
    with pytest.raises(ValueError, match=rf"`devices` lists device {devices[1]!r} twice \(as 'cpu:\d'\)"):
        unison.MirroredStrategy(devices)


def test_duplicate_compute_devices_name_the_field():
    with pytest.raises(ValueError, match=r"`compute_devices` lists device 'cpu:1' twice"):
        unison.CentralStorageStrategy(["cpu:0", "cpu:1", "cpu:1"])


def test_empty_device_list_raises():
    with pytest.raises(ValueError, match=r"`devices` is empty: give at least one device"):
        unison.MirroredStrategy([])


def test_canonicalize_all_accepts_one_name():
    assert canonicalize_all("GPU:1") == ("cuda:1",)
