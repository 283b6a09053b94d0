"""Worker functions that run as tasks of SLURM job steps (module level: spawned processes import them).

Each process is given the variables ``srun`` sets for one task (job id, step id, rank,
the step's single host) and builds MultiWorkerMirroredStrategy by detection, as a
program under ``srun`` does; ranks ``2j`` and ``2j + 1`` of a ``run_workers`` call are
the two tasks of job ``j``.
"""

from __future__ import annotations

import os
import time

import unison
from tests.multi_worker._workers import global_batches, mlp_and_step
from unison._collectives.group.store_connect import OWNER_KEY
from unison.errors import ClusterError


def srun_environment(job_id: int, procid: int, ntasks: int = 2, step_id: int = 0) -> dict[str, str]:
    """The variables srun sets for task ``procid`` of a one-host step."""
    return {
        "SLURM_JOB_ID": str(job_id), "SLURM_STEP_ID": str(step_id), "SLURM_PROCID": str(procid),
        "SLURM_LOCALID": str(procid), "SLURM_NTASKS": str(ntasks), "SLURM_STEP_NUM_TASKS": str(ntasks),
        "SLURM_JOB_NODELIST": "localhost", "SLURM_STEP_NODELIST": "localhost",
        "SLURM_STEP_TASKS_PER_NODE": str(ntasks), "SLURM_TASKS_PER_NODE": str(ntasks),
    }


def slurm_task(rank: int, world: int, jobs: list, timeout_seconds: float, procids: list | None = None):
    """Trains a small MLP as task ``rank % 2`` of job ``jobs[rank // 2]`` = (job id, extra variables).

    Returns ``("trained", job_id, weights, loss, owner)``, ``owner`` the run token that the
    leader of the store this task joined wrote there (its own job's, or the store is another
    run's), or ``("error", job_id, message, seconds, None)``.
    """
    job_id, extra = jobs[rank // 2]
    procid = procids[rank] if procids is not None else rank % 2
    os.environ.pop("UNISON_RENDEZVOUS", None)  # the harness's store: a SLURM task hosts its own
    os.environ.update(srun_environment(job_id, procid))
    os.environ.update(extra)
    start = time.monotonic()
    try:
        strategy = unison.MultiWorkerMirroredStrategy(
            communication_options=unison.CommunicationOptions(timeout_seconds=timeout_seconds))
        assert strategy.extended.components.cluster.environment == "slurm"
        model, step = mlp_and_step(strategy)

        for x, y in global_batches():
            loss = strategy.run(step, args=(x.chunk(2)[procid], y.chunk(2)[procid]))
        # Read while the leader, which hosts the store, still waits for this task in the reduce below.
        store = strategy.extended.components.cross_device_ops.worker_group.store.underlying_store  # unprefixed
        owner = store.get(OWNER_KEY).decode()
        mean = float(strategy.reduce("mean", loss))
        return ("trained", job_id, [p.detach().clone() for p in model.parameters()], mean, owner)
    except ClusterError as exc:
        return ("error", job_id, str(exc), time.monotonic() - start, None)
