"""Tests of ``WorkerPool`` through the session's ``worker_pool`` fixture."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from unison._testing import WorkerFailure, WorkerPool


def _all_reduce_rank_plus_one(rank: int, world_size: int) -> float:
    tensor = torch.tensor([rank + 1.0])
    dist.all_reduce(tensor)
    return tensor.item()


@pytest.mark.timeout(90)
def test_pool_runs_successive_functions_in_the_same_processes(worker_pool: WorkerPool) -> None:
    first = worker_pool.run(lambda rank, world_size: (rank, world_size, os.getpid()))
    generation = worker_pool.generation
    assert [r[:2] for r in first] == [(0, 2), (1, 2)]
    assert {r[2] for r in first} == set(worker_pool.pids)

    scale = 10.0

    def scaled_sum(rank: int, world_size: int, offset: float) -> float:  # A closure.
        return _all_reduce_rank_plus_one(rank, world_size) * scale + offset

    assert worker_pool.run(scaled_sum, 0.5) == [30.5, 30.5]
    pids_again = worker_pool.run(lambda rank, world_size: os.getpid())
    assert pids_again == [r[2] for r in first]
    assert worker_pool.generation == generation


def _set_env_then_read(rank: int, world_size: int, value: str | None) -> str | None:
    before = os.environ.get("UNISON_POOL_LEAK")
    if value is not None:
        os.environ["UNISON_POOL_LEAK"] = value
    return before


@pytest.mark.timeout(90)
def test_pool_member_environment_is_restored_after_each_call(worker_pool: WorkerPool) -> None:
    assert worker_pool.run(_set_env_then_read, "set by a test") == [None, None]
    assert worker_pool.run(_set_env_then_read, None) == [None, None]


def _raise_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise KeyError("missing on rank 1")
    return rank


@pytest.mark.timeout(90)
def test_pool_survives_an_exception_in_one_member(worker_pool: WorkerPool) -> None:
    worker_pool.run(lambda rank, world_size: None)  # Started, before counting restarts.
    generation = worker_pool.generation
    with pytest.raises(WorkerFailure, match=r"rank\(s\) \[1\] failed") as info:
        worker_pool.run(_raise_on_rank_1)
    assert "KeyError: 'missing on rank 1'" in str(info.value)
    assert info.value.results[0].ok and info.value.results[0].value == 0
    # Every member came back, so the same processes serve the next call.
    assert worker_pool.run(_all_reduce_rank_plus_one) == [3.0, 3.0]
    assert worker_pool.generation == generation


def _rank_1_raises_while_rank_0_waits_in_all_reduce(rank: int, world_size: int) -> float:
    if rank == 1:
        raise RuntimeError("rank 1 gave up before the collective")
    return _all_reduce_rank_plus_one(rank, world_size)


@pytest.mark.timeout(90)
def test_pool_restarts_after_a_member_is_left_stuck(worker_pool: WorkerPool) -> None:
    worker_pool.run(lambda rank, world_size: None)
    generation = worker_pool.generation
    with pytest.raises(WorkerFailure, match=r"rank\(s\) \[0\] did not finish") as info:
        worker_pool.run(_rank_1_raises_while_rank_0_waits_in_all_reduce, timeout=30)
    message = str(info.value)
    assert "RuntimeError: rank 1 gave up before the collective" in message
    assert "in all_reduce" in message  # Rank 0's stack, dumped before it was killed.
    assert worker_pool.pids == frozenset()  # Members are gone ...
    assert worker_pool.run(_all_reduce_rank_plus_one) == [3.0, 3.0]  # ... and replaced.
    assert worker_pool.generation == generation + 1


@pytest.mark.timeout(10)
def test_closed_pool_refuses_work() -> None:
    pool = WorkerPool(2)
    pool.close()
    with pytest.raises(RuntimeError, match="closed pool"):
        pool.run(lambda rank, world_size: rank)
