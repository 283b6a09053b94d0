"""Workers that serve the ps tasks in their own processes (``UNISON_PS_IN_WORKERS=1``, ``unison
launch --ps-in-workers``): the hybrid strategy trains as with ps tasks of their own, and a
worker done first serves its ps tasks until the others are done with them."""

from __future__ import annotations

import time

import pytest
import torch

import unison
from tests.ps import _hybrid_workers as hw
from tests.ps.test_hybrid import assert_rows_of_one_device
from unison._cluster.env import UNISON_PS_IN_WORKERS, ps_in_workers
from unison._coordinator.channel import generate_authkey
from unison._launch.procs import reserve_ports
from unison._ps.task_server import HostedPS, hosted_ps_indices
from unison._ps.wire import in_process
from unison._testing import run_workers

IN_WORKERS = {UNISON_PS_IN_WORKERS: "1"}


def _free_addresses(count: int) -> list[str]:
    return [f"127.0.0.1:{port}" for port in reserve_ports(count)]


@pytest.mark.timeout(120)
def test_rows_and_dense_layers_train_as_with_ps_tasks_of_their_own():
    # rows both workers push in a step: a worker's own pull waits, in its own thread, for the push of
    # the other worker that its process serves
    steps = 6
    results = run_workers(hw.train, 2, args=(_free_addresses(2), generate_authkey().hex(), steps, True), timeout=90,
                          env=IN_WORKERS)
    (dense0, state0, stats0), (dense1, state1, _) = results
    for step in range(steps):
        assert all(torch.equal(a, b) for a, b in zip(dense0[step], dense1[step])), step
    assert_rows_of_one_device(state0, steps, 2, shared=True)  # one device on the global batches
    assert torch.equal(state0["rows.rows"], state1["rows.rows"])
    assert all(s["rows"] for s in stats0)  # both ps tasks, one in each worker, hold rows


def read_after_the_other_is_done(rank: int, world: int, ps: list[str], key_hex: str):
    """Worker 1 returns at once (its process exits); worker 0 reads every row a second later, from both
    ps tasks: ps:1 lives in worker 1's process, which must serve it until worker 0 is done."""
    strategy = hw.strategy_for(rank, world, ps, key_hex)
    model, _ = hw._build(strategy)
    ids = torch.arange(40)
    model.rows(ids.view(-1, 1))  # rows made on both ps tasks
    strategy.join_pushes()
    if rank == 1:
        return None
    time.sleep(1.0)
    return model.rows.state_dict()["ids"]


@pytest.mark.timeout(120)
def test_a_worker_done_first_serves_its_ps_tasks_until_the_others_are_done():
    got, _ = run_workers(read_after_the_other_is_done, 2, args=(_free_addresses(2), generate_authkey().hex()),
                         timeout=90, env=IN_WORKERS)
    assert torch.equal(got, torch.arange(40))


def test_each_worker_serves_every_ps_task_of_its_index_modulo_the_workers():
    assert hosted_ps_indices(5, 2, 0) == [0, 2, 4] and hosted_ps_indices(5, 2, 1) == [1, 3]
    assert hosted_ps_indices(1, 3, 2) == [] and hosted_ps_indices(2, 0, 0) == []


def test_only_workers_serve_and_only_when_asked():
    jobs = {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"], "ps": _free_addresses(1)}
    key = generate_authkey()
    assert HostedPS.for_task(jobs, "worker", 0, key, environ={}) is None
    assert HostedPS.for_task(jobs, "chief", 0, key, environ=IN_WORKERS) is None
    assert HostedPS.for_task({"worker": jobs["worker"]}, "worker", 0, key, environ=IN_WORKERS) is None
    hosted = HostedPS.for_task(jobs, "worker", 0, key, environ=IN_WORKERS)
    try:
        assert hosted is not None and hosted.indices == [0]
    finally:
        assert hosted is not None
        hosted.stop()


def test_a_bad_setting_is_named_with_its_fix():
    assert ps_in_workers({UNISON_PS_IN_WORKERS: "1"}) and not ps_in_workers({}) and not ps_in_workers({
        UNISON_PS_IN_WORKERS: "0"})
    with pytest.raises(ValueError, match=r"UNISON_PS_IN_WORKERS='yes' is neither '1'.*fix: set it to 1 or 0"):
        ps_in_workers({UNISON_PS_IN_WORKERS: "yes"})


def test_a_worker_server_serves_its_ps_tasks_until_it_stops(monkeypatch):
    # the asynchronous ParameterServerStrategy: workers run unison.Server, which serves their ps tasks too
    monkeypatch.setenv(UNISON_PS_IN_WORKERS, "1")
    addresses = _free_addresses(4)
    jobs = {"worker": addresses[:2], "ps": addresses[2:]}
    server = unison.Server(jobs, "worker", 1, authkey=generate_authkey())
    try:
        assert in_process.opener_for(addresses[3]) is not None  # ps:1 (1 % 2 == 1), here
        assert in_process.opener_for(addresses[2]) is None  # ps:0 is worker 0's
    finally:
        server.stop()
    assert in_process.opener_for(addresses[3]) is None


def test_a_worker_server_made_without_starting_serves_nothing_yet(monkeypatch):
    monkeypatch.setenv(UNISON_PS_IN_WORKERS, "1")
    addresses = _free_addresses(2)
    server = unison.Server({"worker": addresses[:1], "ps": addresses[1:]}, "worker", 0, authkey=generate_authkey(),
                           start=False)
    assert in_process.opener_for(addresses[1]) is None
    server.start()
    try:
        assert in_process.opener_for(addresses[1]) is not None
    finally:
        server.stop()
