"""Restarts that keep the ps tasks: a hybrid job's workers start again, its ps tasks and their rows stay.

A job with ps tasks and no chief trains with HybridParameterServerStrategy: the workers
are a MultiWorkerMirrored group, the ps tasks hold the embedding rows. When a worker
fails, its group ends as under MWMS and ``--max-restarts`` starts the workers again,
but the ps tasks are separate processes holding state no checkpoint may have caught
yet: they keep running at the same addresses, and the new workers find the tables they
made. A job with a chief (ParameterServerStrategy) restarts whole, as before.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import IO

from unison._cluster import env
from unison._launch.one_run import run_once
from unison._launch.outcome import exit_code
from unison._launch.procs import LocalCluster, Task, cluster_environments

__all__ = ["keeps_ps_tasks", "run_keeping_ps_tasks"]


def keeps_ps_tasks(tasks: Sequence[Task]) -> bool:
    """Whether a restart keeps the ps tasks running: they exist and no chief coordinates them."""
    types = {task.type for task in tasks}
    return "ps" in types and "chief" not in types


def run_keeping_ps_tasks(command: Sequence[str], tasks: Sequence[Task], *, authkey: bytes, max_restarts: int,
                         grace_period: float, base: Mapping[str, str], stdout: IO[str], stderr: IO[str],
                         cores: Mapping[Task, Sequence[int]] | None = None) -> int:
    """Like ``run_local_cluster``, but each restart starts only the tasks that are not ps tasks
    (``cores``: each task's CPUs, the ps tasks' kept across restarts)."""
    first = cluster_environments(tasks, authkey=authkey, restart=0, base=base)
    ps_tasks = [task for task in tasks if task.type == "ps"]
    others = [task for task in tasks if task.type != "ps"]
    ps_addresses = _addresses_of(first, "ps")
    ps = LocalCluster(command, {task: first[task] for task in ps_tasks}, grace_period=grace_period,
                      stdout=stdout, stderr=stderr, cores=cores)
    try:
        ps.start()
        for attempt in range(max_restarts + 1):
            environments = first if attempt == 0 else cluster_environments(
                tasks, authkey=authkey, restart=attempt, base=base, kept={"ps": ps_addresses})
            training = LocalCluster(command, {task: environments[task] for task in others},
                                    grace_period=grace_period, stdout=stdout, stderr=stderr, cores=cores)
            outcome = run_once(training)
            if isinstance(outcome, int):
                return outcome
            if outcome.failed is None:
                return 0
            failure = outcome.describe_failure()
            training.message(f"{failure}; stopped the other training task(s)")
            lost = ps.exited()
            if lost:
                training.message(f"cluster failed: {failure}; {', '.join(lost)} exited too, and its rows with it: "
                                 f"no restart can go on from them (restore a checkpoint)")
                return exit_code(outcome.returncode)
            if attempt < max_restarts:
                training.message(f"restarting the workers (restart {attempt + 1} of {max_restarts}); the ps tasks "
                                 f"keep running with their rows")
                continue
            training.message(f"cluster failed: {failure}")
            return exit_code(outcome.returncode)
        raise AssertionError("unreachable: the loop returns")
    finally:
        ps.stop()


def _addresses_of(environments: Mapping[Task, Mapping[str, str]], job: str) -> list[str]:
    config = json.loads(next(iter(environments.values()))[env.TF_CONFIG])
    return list(config["cluster"][job])
