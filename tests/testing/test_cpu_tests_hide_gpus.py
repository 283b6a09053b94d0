"""Processes started by the suite's CPU tests see no GPU (``tests/conftest.py``)."""

from __future__ import annotations

import os

import pytest

from unison._testing import run_workers

pytestmark = pytest.mark.timeout(60)


def _visible_devices(rank: int, world: int) -> str | None:
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def test_a_cpu_tests_workers_see_no_gpu():
    assert run_workers(_visible_devices, 1, timeout=30) == [""]


@pytest.fixture(scope="module")
def workers_started_by_a_module_fixture() -> list[str | None]:
    return run_workers(_visible_devices, 1, timeout=30)


def test_a_module_scoped_fixtures_workers_see_no_gpu(workers_started_by_a_module_fixture):
    # A reference run launched once per module starts before any function-scoped fixture.
    assert workers_started_by_a_module_fixture == [""]
