"""SLURM job steps as real processes on one host, without SLURM: each process gets the
variables srun sets. Two concurrent jobs both train; runs that meet on one port, a port
held by another program and a leader that never comes end in clear errors in time."""

from __future__ import annotations

import random
import socket

import pytest

from tests.cluster import _slurm_workers as sw
from tests.multi_worker._workers import single_device_weights
from unison._cluster.slurm import rendezvous_port
from unison._testing import run_workers

TIMEOUT_S = 8.0  # the strategies' timeout_seconds


def _free_job_ids(count: int) -> list[int]:
    """Job ids whose derived leader ports (and the next) nothing on this host listens on now."""
    found: list[int] = []
    rng = random.Random()
    while len(found) < count:
        job = rng.randrange(10**5, 10**7)
        port = rendezvous_port(job, 0)
        if any(rendezvous_port(other, 0) == port for other in found):
            continue
        try:
            for p in (port, port + 1):
                with socket.socket() as s:
                    s.bind(("", p))
        except OSError:
            continue
        found.append(job)
    return found


@pytest.mark.timeout(150)
def test_two_concurrent_jobs_on_one_host_both_train():
    job_a, job_b = _free_job_ids(2)
    results = run_workers(sw.slurm_task, 4, args=([(job_a, {}), (job_b, {})], 60.0), timeout=120)
    reference = single_device_weights()
    assert [(r[0], r[1]) for r in results] == [("trained", job_a)] * 2 + [("trained", job_b)] * 2, \
        [r[2] for r in results if r[0] == "error"]
    for _, job, weights, _, owner in results:
        assert owner == f"slurm-job{job}-step0"  # each task joined its own job's store
        for got, want in zip(weights, reference):
            assert (got - want).abs().max().item() <= 1e-5
    assert results[0][3] == pytest.approx(results[1][3]) and results[2][3] == pytest.approx(results[3][3])


@pytest.mark.timeout(120)
def test_two_jobs_given_one_port_never_join_each_others_store():
    # Both jobs are told MASTER_PORT=port: one leader hosts it, the other cannot bind it (or
    # binds it only after the first job ended), and the other job's worker reaches the first
    # job's store and is turned away.
    job_a, job_b = _free_job_ids(2)
    port = rendezvous_port(job_a, 0)
    same_port = {"MASTER_PORT": str(port)}
    results = run_workers(sw.slurm_task, 4, args=([(job_a, same_port), (job_b, same_port)], TIMEOUT_S), timeout=90)
    by_job = {job: [r for r in results if r[1] == job] for job in (job_a, job_b)}
    winners = [job for job, rs in by_job.items() if all(r[0] == "trained" for r in rs)]
    assert winners, results
    # Every task that trained did so in a store its own job's leader hosts (the owner key it
    # read there): in every outcome, no task joined the other job's store.
    trained = [(job, owner) for kind, job, _, _, owner in results if kind == "trained"]
    assert all(owner == f"slurm-job{job}-step0" for job, owner in trained), trained
    if len(winners) == 2:  # the first job ended and freed the port before the second's leader bound it
        return
    loser = by_job[({job_a, job_b} - set(winners)).pop()]
    leader_error, worker_error = loser[0][2], loser[1][2]
    assert loser[0][0] == loser[1][0] == "error"
    # The losing leader either found the port held ("hosting ... at" it), or -- when its
    # process started only after the winner had ended and freed the port -- hosted it and
    # waited in vain for its worker, which had already been turned away by the winner.
    assert f"127.0.0.1:{port}" in leader_error, leader_error
    assert ("hosting the rendezvous store" in leader_error
            or "worker:1 never arrived at the rendezvous store" in leader_error), leader_error
    # The losing worker never joins the other run: it is turned away by the owner key when it
    # reads it, or (when it connects before the winner's leader wrote it, and its own leader
    # never comes) it names its own missing leader within the timeout. Never a joined store.
    turned_away = "belongs to another run" in worker_error and f"slurm-job{winners[0]}-step0" in worker_error
    assert turned_away or "could not join" in worker_error, worker_error
    assert max(loser[0][3], loser[1][3]) < TIMEOUT_S + 10


@pytest.mark.timeout(120)
def test_a_port_held_by_another_program_ends_in_a_clear_error_in_time():
    # 3 s, not TIMEOUT_S: neither task waits for the other to start (the leader cannot bind the
    # port, the worker reaches the squatter), so the timeout is only waited out; a worker still
    # reading the squatter's answer after it is the hang this guards, whatever its length.
    timeout = 3.0
    with socket.socket() as squatter:  # accepts connections and never answers
        squatter.bind(("", 0))
        squatter.listen(8)
        port = squatter.getsockname()[1]
        job, = _free_job_ids(1)
        results = run_workers(sw.slurm_task, 2, args=([(job, {"MASTER_PORT": str(port)})], timeout), timeout=90)
    (kind0, _, leader_error, leader_s, _), (kind1, _, worker_error, worker_s, _) = results
    assert kind0 == kind1 == "error", results
    assert f"127.0.0.1:{port}" in leader_error and "hosting the rendezvous store" in leader_error
    assert "does not answer as a torch.distributed store" in worker_error
    assert leader_s < timeout + 10 and worker_s < timeout + 10


@pytest.mark.timeout(90)
def test_a_leader_that_never_comes_ends_in_a_clear_error_in_time():
    job, = _free_job_ids(1)
    # Only task 1 of the job's two runs: nothing ever listens at the leader's port.
    (kind, _, message, seconds, _), = run_workers(sw.slurm_task, 1, args=([(job, {})], TIMEOUT_S, [1]), timeout=60)
    assert kind == "error", message
    assert f"127.0.0.1:{rendezvous_port(job, 0)}" in message and "worker:1" in message
    assert TIMEOUT_S - 1 < seconds < TIMEOUT_S + 10
