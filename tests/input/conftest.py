"""Helpers for simulating several workers' input pipelines in one process."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from unison._values.values import PerReplica


def replica_components(step: Any, num_replicas: int) -> list[torch.Tensor]:
    """The per-replica tensors of a step whose batch is a single tensor."""
    if num_replicas == 1:
        assert isinstance(step, torch.Tensor)
        return [step]
    assert isinstance(step, PerReplica)
    assert len(step.values) == num_replicas
    return list(step.values)


def run_workers(make: Callable[[int], Any], num_workers: int, num_replicas: int) -> list[list[list[torch.Tensor]]]:
    """Iterates one distributed dataset per worker; returns [worker][step][replica] tensors."""
    return [[replica_components(s, num_replicas) for s in make(w)] for w in range(num_workers)]


class ThreadAgree:
    """``agree`` for workers simulated as threads: True only if every worker has data."""

    def __init__(self, num_workers: int):
        self._slots = [False] * num_workers
        self._barrier = threading.Barrier(num_workers, timeout=10)
        self.calls = [0] * num_workers

    def for_worker(self, worker: int) -> Callable[[bool], bool]:
        def agree(has_data: bool) -> bool:
            self.calls[worker] += 1
            self._slots[worker] = has_data
            self._barrier.wait()
            result = all(self._slots)
            self._barrier.wait()
            return result

        return agree


def run_threads(fns: list[Callable[[], Any]]) -> list[Any]:
    """Runs one function per simulated worker in its own thread; re-raises the first error."""
    results: list[Any] = [None] * len(fns)
    errors: list[BaseException] = []

    def target(i: int) -> None:
        try:
            results[i] = fns[i]()
        except BaseException as e:  # reported to the test below
            errors.append(e)

    threads = [threading.Thread(target=target, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert not any(t.is_alive() for t in threads), "a simulated worker hung"
    if errors:
        raise errors[0]
    return results


@pytest.fixture(scope="session")
def helpers() -> Any:
    class _Helpers:
        replica_components = staticmethod(replica_components)
        run_workers = staticmethod(run_workers)
        run_threads = staticmethod(run_threads)
        ThreadAgree = ThreadAgree

    return _Helpers
