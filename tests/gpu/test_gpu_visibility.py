"""GPU tests see the GPUs the session was started with, whatever CPU tests ran before them.

Not skipped without a GPU: it checks the suite's environment handling, which a CPU
machine runs too (``tests/gpu`` comes after most CPU test directories).
"""

from __future__ import annotations

import os

import pytest

from unison._testing import run_workers

pytestmark = pytest.mark.timeout(60)


def _visible_devices(rank: int, world: int) -> str | None:
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def test_gpu_tests_and_their_workers_see_the_sessions_gpus(session_cuda_visible_devices):
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == session_cuda_visible_devices
    assert run_workers(_visible_devices, 1, timeout=30) == [session_cuda_visible_devices]
