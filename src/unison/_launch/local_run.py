"""``run_local_cluster``: every task of a local cluster, restarted as a whole up to a limit.

A hybrid job (ps tasks, no chief) restarts only its other tasks and keeps the ps tasks
running (:mod:`unison._launch.kept_ps`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from typing import IO

from unison._cluster import env
from unison._launch.core_binding import plan_cores
from unison._launch.interrupts import install_signal_handlers, restore_signal_handlers
from unison._launch.kept_ps import keeps_ps_tasks, run_keeping_ps_tasks
from unison._launch.one_run import run_once
from unison._launch.outcome import exit_code
from unison._launch.procs import LocalCluster, Task, cluster_environments

__all__ = ["run_local_cluster"]


def run_local_cluster(
    command: Sequence[str],
    tasks: Sequence[Task],
    *,
    authkey: bytes,
    max_restarts: int = 0,
    grace_period: float = 5.0,
    base_env: Mapping[str, str] | None = None,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
    ps_in_workers: bool = False,
    bind_cores: bool = False,
) -> int:
    """Runs ``command`` once per task until the cluster succeeds or runs out of restarts.

    ``ps_in_workers``: the ps tasks keep their addresses in ``TF_CONFIG`` but get no process;
    the workers serve them (``UNISON_PS_IN_WORKERS=1``, :mod:`unison._ps.task_server`).
    ``bind_cores``: each task's process on CPUs of its own (:mod:`unison._launch.core_binding`).

    Ctrl-C (SIGINT) and SIGTERM stop every task. Returns 0 on success; the failed task's
    exit code (128 + N for signal N) on failure; 130 / 143 when interrupted.

    Raises:
        ValueError: for ``ps_in_workers`` with ``max_restarts`` (a restart would lose the rows); for
            ``bind_cores`` with more processes than CPUs.
    """
    if ps_in_workers and max_restarts:
        raise ValueError(f"ps_in_workers keeps the rows in the workers' processes, so a restart would lose them; "
                         f"max_restarts={max_restarts} needs ps tasks of their own: pass one of the two")
    started = [task for task in tasks if not (ps_in_workers and task.type == "ps")]
    cores = plan_cores(started) if bind_cores else None
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    base = dict(os.environ if base_env is None else base_env)
    if ps_in_workers:
        base[env.UNISON_PS_IN_WORKERS] = "1"
    previous = install_signal_handlers()
    try:
        if max_restarts and keeps_ps_tasks(tasks):
            return run_keeping_ps_tasks(command, tasks, authkey=authkey, max_restarts=max_restarts,
                                        grace_period=grace_period, base=base, stdout=stdout, stderr=stderr,
                                        cores=cores)
        for attempt in range(max_restarts + 1):
            environments = cluster_environments(tasks, authkey=authkey, restart=attempt, base=base)
            if ps_in_workers:
                environments = {task: task_env for task, task_env in environments.items() if task.type != "ps"}
            cluster = LocalCluster(command, environments, grace_period=grace_period, stdout=stdout, stderr=stderr,
                                   cores=cores)
            outcome = run_once(cluster)
            if isinstance(outcome, int):
                return outcome
            if outcome.failed is None:
                return 0
            code = exit_code(outcome.returncode)
            failure = outcome.describe_failure()
            cluster.message(f"{failure}; stopped the other {len(environments) - 1} task(s)")
            if attempt < max_restarts:
                cluster.message(f"restarting the cluster (restart {attempt + 1} of {max_restarts})")
                continue
            cluster.message(f"cluster failed: {failure}")
            return code
        raise AssertionError("unreachable: the loop returns")
    finally:
        restore_signal_handlers(previous)


