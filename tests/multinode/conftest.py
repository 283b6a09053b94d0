"""Fixtures for multi-node tests: simulated hosts (network namespaces with private /dev/shm)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from unison._testing.hosts import SimulatedHosts, unavailable_reason


@pytest.fixture
def simulated_hosts() -> Iterator[Callable[..., SimulatedHosts]]:
    """A factory ``make(count=2, shm_size=..., shm_sizes=..., link_delay_ms=..., link_rate=...)``.

    Skips the test, with the reason, where the machine does not allow namespaces. Every
    host made is torn down after the test (processes killed, namespaces deleted), pass
    or fail.
    """
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    made: list[SimulatedHosts] = []

    def make(count: int = 2, **options: Any) -> SimulatedHosts:
        hosts = SimulatedHosts(count, **options)
        hosts.__enter__()
        made.append(hosts)
        return hosts

    yield make
    for hosts in made:
        hosts.close()
