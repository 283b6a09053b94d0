"""Fixtures for the strategy-core tests: strategies on logical CPU devices."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

import unison


@pytest.fixture(autouse=True)
def _one_intra_op_thread() -> Iterator[None]:
    """One intra-op thread: replica threads already use the 2 cores, and an OpenMP pool
    contending with them (and with other processes) makes tiny ops ~100x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def mirrored2() -> unison.MirroredStrategy:
    """MirroredStrategy over two logical CPU devices."""
    return unison.MirroredStrategy(["cpu:0", "cpu:1"])


@pytest.fixture
def central2() -> unison.CentralStorageStrategy:
    """CentralStorageStrategy computing on two logical CPU devices, parameters on cpu:0."""
    return unison.CentralStorageStrategy(compute_devices=["cpu:0", "cpu:1"], parameter_device="cpu:0")


@pytest.fixture
def one_device() -> unison.OneDeviceStrategy:
    return unison.OneDeviceStrategy("cpu:0")


@pytest.fixture
def thread_baseline() -> Iterator[int]:
    """Asserts after the test that ``threading.active_count()`` is back to its value before.

    The suite-wide leak fixture only sees non-daemon threads; replica threads are
    daemons, so this checks that ``run`` joined them all (none left waiting in merge_call).
    """
    before = threading.active_count()
    yield before
    assert threading.active_count() == before, (
        f"threads left running: {[t.name for t in threading.enumerate()]}"
    )
