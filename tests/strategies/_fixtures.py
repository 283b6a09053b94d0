"""Fixtures for the in-process strategy tests: strategies on logical CPU devices.

The conftest.py of tests/strategies, values, gradient_sync, interpose and devices
imports them, so every test there runs with one intra-op thread and can ask for
``mirrored2``, ``central2``, ``one_device`` and ``thread_baseline``.
"""

from __future__ import annotations

import gc
import threading
import time
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
    """Asserts after the test that no thread it started is still busy.

    The suite-wide leak fixture only sees non-daemon threads; replica threads are
    daemons kept between steps, so this checks that every replica thread is back to
    waiting for the next step (none left waiting in merge_call or running a step), and
    that any other thread the test started has ended.
    """
    before = set(threading.enumerate())
    yield len(before)
    gc.collect()  # strategies the test dropped stop their replica threads
    deadline = time.monotonic() + 3.0
    while True:
        busy = [t for t in threading.enumerate()
                if t not in before and not (t.name.startswith("unison-replica-") and _idle(t))]
        if not busy or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert not busy, f"threads left running: {[t.name for t in busy]}"


def _idle(thread: threading.Thread) -> bool:
    from unison._strategies.replicas import replica_thread_is_idle

    return replica_thread_is_idle(thread)
