"""``unison launch --nnodes N``: one launcher per node, one job across the nodes.

Run the same command on every node, each with its own ``--node-rank``::

    unison launch --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --workers-per-node 2 train.py
    unison launch --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --workers-per-node 2 train.py

Each launcher starts its node's tasks with a ``TF_CONFIG`` naming every task of every
node, as torchrun does for ``RANK``/``WORLD_SIZE``: the launchers meet at a store that
node 0's launcher hosts at the master address (see
:mod:`unison._launch.node_rendezvous`), where each publishes its reachable address and
free ports and node 0 a fresh cluster key. Worker indices follow node ranks: node ``r``
runs workers ``r*K .. r*K+K-1``. ``--chief``, ``--ps M`` and ``--evaluator`` add their
tasks on node 0 only (the chief then leads the collective group, as on one node). The
flags and their check are ``multinode_flags.py``; this module runs one node's part.

Node 0's launcher also hosts the workers' own rendezvous store (``UNISON_RENDEZVOUS``),
one per generation, so it outlives every worker. A task that fails on any node ends the
job on every node: its launcher records the failure in the store, the other tasks get
``SETTLE_SECONDS`` to fail by themselves (their ``PeerLostError`` names the lost task,
read from the heartbeats in that store), then every launcher stops its tasks and exits
with the failed task's exit code, naming it. With ``--max-restarts K`` every node restarts together: the next
generation re-runs the rendezvous (fresh ports and key) and the tasks see
``UNISON_RESTART_COUNT``. A launcher that vanishes (its heartbeat stops) fails the job
on the other nodes after ``--rendezvous-timeout`` seconds.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO, TYPE_CHECKING

from unison._cluster import env
from unison._launch.core_binding import plan_cores
from unison._launch.interrupts import Interrupted, install_signal_handlers, restore_signal_handlers
from unison._launch.node_address import address_toward, interface_of
from unison._launch.node_rendezvous import (
    Failure,
    NodeRendezvous,
    NodeTasks,
    format_address,
)
from unison._launch.outcome import exit_code, signal_name
from unison._launch.procs import LocalCluster, Task, reserve_ports, shared_environment
from unison.errors import ClusterError

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = [
    "NodePlan",
    "plan_node",
    "job_cluster",
    "node_environments",
    "run_node",
    "DEFAULT_MASTER_PORT",
    "DEFAULT_RENDEZVOUS_TIMEOUT",
]

#: torchrun's default ``--master-port``.
DEFAULT_MASTER_PORT = 29500
#: Seconds a launcher waits for the store and for the other nodes (``--rendezvous-timeout``).
DEFAULT_RENDEZVOUS_TIMEOUT = 300.0

#: Seconds the other tasks get to fail by themselves (naming the lost peer) before SIGTERM.
SETTLE_SECONDS = 3.0

_JOB_ORDER = ("chief", "worker", "ps", "evaluator")


@dataclasses.dataclass(frozen=True)
class NodePlan:
    """What one node of a multi-node job runs.

    Attributes:
        nnodes: how many nodes.
        node_rank: this node's rank.
        workers_per_node: workers on every node.
        tasks: this node's tasks, with their job-wide indices.
        node0_extras: the names of the tasks other than workers, which node 0 runs
            (every node knows them, to check that all were started alike).
    """

    nnodes: int
    node_rank: int
    workers_per_node: int
    tasks: tuple[Task, ...]
    node0_extras: tuple[str, ...] = ()


def plan_node(
    nnodes: int, node_rank: int, workers_per_node: int, *, chief: bool = False, ps: int = 0, evaluator: bool = False
) -> NodePlan:
    """The tasks of node ``node_rank``: its workers, and on node 0 the chief, ps and evaluator.

    Raises:
        ValueError: for counts out of range, naming the flag and the fix.
    """
    for flag, value, low in (("--nnodes", nnodes, 1), ("--workers-per-node", workers_per_node, 0), ("--ps", ps, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{flag} {value!r} is not an integer >= {low}; fix {flag}")
    if isinstance(node_rank, bool) or not isinstance(node_rank, int) or not 0 <= node_rank < nnodes:
        raise ValueError(
            f"--node-rank {node_rank!r} is not in 0..{nnodes - 1} (--nnodes {nnodes}); give each node its own rank"
        )
    if workers_per_node == 0 and not chief:
        raise ValueError("a multi-node job needs workers: pass --workers-per-node K (K >= 1)")
    tasks = [Task("worker", node_rank * workers_per_node + i) for i in range(workers_per_node)]
    extras = [Task("ps", i) for i in range(ps)] + ([Task("evaluator", 0)] if evaluator else [])
    if node_rank == 0:
        tasks = ([Task("chief", 0)] if chief else []) + tasks + extras
    names = (["chief:0"] if chief else []) + [t.name for t in extras]
    return NodePlan(nnodes, node_rank, workers_per_node, tuple(tasks), tuple(names))


def job_cluster(nodes: Sequence[NodeTasks]) -> dict[str, list[str]]:
    """The TF_CONFIG ``cluster`` of the whole job: each job's tasks in index order."""
    found: dict[str, dict[int, str]] = {}
    for node in nodes:
        host = f"[{node.address}]" if ":" in node.address else node.address
        for job, index, port in node.tasks:
            found.setdefault(job, {})[index] = f"{host}:{port}"
    cluster = {}
    for job in sorted(found, key=lambda j: (_JOB_ORDER.index(j) if j in _JOB_ORDER else len(_JOB_ORDER), j)):
        indices = found[job]
        if sorted(indices) != list(range(len(indices))):
            raise ClusterError(f"the nodes' {job} tasks have indices {sorted(indices)}, not 0..{len(indices) - 1}")
        cluster[job] = [indices[i] for i in range(len(indices))]
    return cluster


def node_environments(
    plan: NodePlan,
    nodes: Sequence[NodeTasks],
    *,
    authkey: bytes,
    restart: int,
    base: Mapping[str, str],
    node_addr: str,
) -> dict[Task, dict[str, str]]:
    """The environment of each of this node's tasks: the job-wide TF_CONFIG and the shared settings."""
    coordinator = nodes[0].coordinator_port
    if coordinator is None:
        raise ClusterError("node 0 published no coordinator port")
    shared = shared_environment(base, authkey=authkey, coordinator_port=coordinator, restart=restart)
    if nodes[0].store_port is not None:
        shared[env.UNISON_RENDEZVOUS] = format_address(nodes[0].address, nodes[0].store_port)
    interface = interface_of(node_addr)
    if interface is not None and "GLOO_SOCKET_IFNAME" not in shared:
        shared["GLOO_SOCKET_IFNAME"] = interface  # gloo must listen where the other nodes can reach it
    cluster = job_cluster(nodes)
    result = {}
    for task in plan.tasks:
        task_env = dict(shared)
        task_env[env.TF_CONFIG] = json.dumps({"cluster": cluster, "task": {"type": task.type, "index": task.index}})
        result[task] = task_env
    return result


class _Monitor:
    """``stop_when`` for the node's tasks: another node failed, or went silent."""

    def __init__(self, rendezvous: NodeRendezvous, generation: int, silence_limit: float) -> None:
        self.rendezvous, self.generation, self.limit = rendezvous, generation, silence_limit
        self.failure: Failure | None = None

    def __call__(self) -> bool:
        self.failure = self.check()
        return self.failure is not None

    def check(self) -> Failure | None:
        try:
            self.rendezvous.beat(self.generation)
            failure = self.rendezvous.failure(self.generation)
            if failure is not None:
                return failure
            silent = self.rendezvous.silent_node(self.generation, self.limit)
        except (RuntimeError, OSError) as e:  # the store is gone: node 0's launcher died
            return Failure("", 0, 1, f"(node 0's launcher) stopped answering at {self.rendezvous.master}: {e}")
        if silent is None:
            return None
        failure = Failure("", silent, 1, f"(its launcher) stopped answering for {self.limit:g} s")
        return self.rendezvous.report_failure(self.generation, failure)


def _describe(failure: Failure) -> str:
    return failure.describe() if failure.task else f"node {failure.node} {failure.detail}"


def run_node(
    command: Sequence[str],
    plan: NodePlan,
    *,
    master_addr: str,
    master_port: int = DEFAULT_MASTER_PORT,
    node_addr: str | None = None,
    max_restarts: int = 0,
    grace_period: float = 5.0,
    rendezvous_timeout: float = DEFAULT_RENDEZVOUS_TIMEOUT,
    base_env: Mapping[str, str] | None = None,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
    bind_cores: bool = False,
) -> int:
    """Runs this node's tasks of a multi-node job until the job succeeds or runs out of restarts.

    Returns 0 when every task of every node succeeded; the failed task's exit code
    (on every node) when one failed; 128 + N when this launcher got signal N; 1 when
    the rendezvous failed (the message names the missing node and the master).
    ``bind_cores``: each of this node's tasks on CPUs of its own (:mod:`unison._launch.core_binding`).

    Raises:
        ValueError: for ``bind_cores`` with more tasks on this node than CPUs (before anything starts).
    """
    cores = plan_cores(plan.tasks) if bind_cores else None
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    base = dict(os.environ if base_env is None else base_env)

    def say(text: str) -> None:
        stderr.write(f"unison launch: node {plan.node_rank}: {text}\n")
        stderr.flush()

    # Every node must agree on these; node 0's extra tasks (chief, ps, evaluator) too, so a
    # node started with other flags is refused rather than silently ignored.
    config: dict[str, object] = {
        "--nnodes": plan.nnodes,
        "--workers-per-node": plan.workers_per_node,
        "--max-restarts": max_restarts,
    }
    config["--chief/--ps/--evaluator"] = list(plan.node0_extras)
    previous = install_signal_handlers()
    try:
        try:
            node_addr = node_addr or address_toward(master_addr, master_port)
            rendezvous = NodeRendezvous(
                nnodes=plan.nnodes, node_rank=plan.node_rank, master_addr=master_addr, master_port=master_port,
                timeout=rendezvous_timeout, config=config,
            )  # fmt: skip
        except (ClusterError, ValueError) as e:
            say(str(e))
            return 1
        except (KeyboardInterrupt, Interrupted) as e:
            return 128 + (e.signum if isinstance(e, Interrupted) else signal.SIGINT)
        code, generation = _run_generations(
            command, plan, rendezvous, node_addr, max_restarts, grace_period, rendezvous_timeout, base, stdout, stderr,
            say, cores,
        )
        if plan.node_rank == 0 and generation >= 0 and code < 128:
            # The store lives in this process: keep it until the others read the outcome.
            rendezvous.wait_acknowledged(generation, limit=min(10.0, rendezvous_timeout))
        return code
    finally:
        restore_signal_handlers(previous)


def _run_generations(
    command: Sequence[str],
    plan: NodePlan,
    rendezvous: NodeRendezvous,
    node_addr: str,
    max_restarts: int,
    grace_period: float,
    silence_limit: float,
    base: Mapping[str, str],
    stdout: IO[str],
    stderr: IO[str],
    say: Callable[[str], None],
    cores: Mapping[Task, Sequence[int]] | None = None,
) -> tuple[int, int]:
    """Runs generation after generation; returns the exit code and the last generation."""
    hosted: list[dist.Store] = []  # node 0: this generation's workers' store, kept open while they run
    for generation in range(max_restarts + 1):
        cluster = None
        hosted.clear()  # the previous generation's store closes: its keys are stale
        try:
            ports = reserve_ports(len(plan.tasks) + (2 if plan.node_rank == 0 else 0), node_addr)
            tasks = tuple((t.type, t.index, p) for t, p in zip(plan.tasks, ports))
            try:
                if plan.node_rank == 0:
                    hosted.append(_host_worker_store(node_addr, ports[-1], silence_limit))
                    mine = NodeTasks(0, node_addr, tasks, coordinator_port=ports[-2], store_port=ports[-1])
                else:
                    mine = NodeTasks(plan.node_rank, node_addr, tasks)
                nodes, authkey = rendezvous.join(generation, mine)
            except ClusterError as e:
                say(str(e))
                return 1, -1  # no generation ran: nobody is waiting to read an outcome
            if plan.node_rank == 0:
                where = ", ".join(f"node {n.rank} at {n.address}" for n in nodes)
                say(f"generation {generation}: {where}")
            environments = node_environments(
                plan, nodes, authkey=authkey, restart=generation, base=base, node_addr=node_addr
            )
            cluster = LocalCluster(
                command, environments, grace_period=grace_period, stdout=stdout, stderr=stderr,
                settle_period=SETTLE_SECONDS, cores=cores,
            )
            monitor = _Monitor(rendezvous, generation, silence_limit)
            try:
                cluster.start()
            except BaseException:
                cluster.stop()
                raise
            outcome = cluster.wait(stop_when=monitor)
            failure: Failure | None
            if outcome.failed is not None:
                detail = f"exited with code {exit_code(outcome.returncode)}"
                if outcome.returncode < 0:
                    detail += f" (killed by {signal_name(-outcome.returncode)})"
                if outcome.notified:  # only this node's tasks are seen; another node's may have had one too
                    where = f"{', '.join(outcome.notified)} on node {plan.node_rank}"
                    if exit_code(outcome.returncode) == env.PREEMPTED_EXIT_CODE:
                        detail += f": the job was preempted (notice to {where})"
                    else:
                        detail += f"; a preemption notice went to {where}"
                failure = rendezvous.report_failure(
                    generation, Failure(outcome.failed.name, plan.node_rank, exit_code(outcome.returncode), detail)
                )
            elif outcome.stopped:
                failure = monitor.failure
            else:
                rendezvous.report_done(generation)
                failure = _wait_for_job(rendezvous, monitor, generation)
        except (KeyboardInterrupt, Interrupted) as e:
            signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
            if cluster is not None:
                cluster.stop()
            try:
                rendezvous.report_failure(
                    generation,
                    Failure(
                        "", plan.node_rank, 128 + signum, f"(its launcher) was interrupted by {signal_name(signum)}"
                    ),
                )
            except (RuntimeError, OSError):
                pass  # the store is gone already; the other nodes notice that too
            say(f"interrupted by {signal_name(signum)}; stopped this node's tasks and told the other nodes")
            return 128 + signum, generation
        if failure is None:
            _acknowledge(rendezvous, plan, generation)
            return 0, generation
        say(f"{_describe(failure)}; stopped this node's {len(plan.tasks)} task(s)")
        if generation < max_restarts:
            say(f"restarting the job on every node (restart {generation + 1} of {max_restarts})")
            continue
        say(f"job failed: {_describe(failure)}")
        _acknowledge(rendezvous, plan, generation)
        return failure.code or 1, generation
    raise AssertionError("unreachable: the loop returns")


def _host_worker_store(address: str, port: int, timeout: float) -> dist.Store:
    """Node 0's launcher hosts the workers' rendezvous store for one generation.

    Hosted by the launcher rather than by the collective leader's process, the store
    outlives any worker: when a worker dies, the others' collectives can still read
    every task's heartbeat there and name the one that stopped (with the store in the
    leader, a leader that exits first would be named instead).
    """
    import torch.distributed as dist  # here, not at the top: a one-node launch never imports torch

    try:
        return dist.TCPStore(
            address, port, None, True, timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False
        )
    except (RuntimeError, OSError) as e:
        raise ClusterError(
            f"node 0 could not host the workers' rendezvous store at {format_address(address, port)} ({e})"
        ) from e


def _acknowledge(rendezvous: NodeRendezvous, plan: NodePlan, generation: int) -> None:
    if plan.node_rank != 0:
        try:
            rendezvous.acknowledge(generation)
        except (RuntimeError, OSError):
            pass  # node 0 is gone: nobody waits for us


def _wait_for_job(rendezvous: NodeRendezvous, monitor: _Monitor, generation: int) -> Failure | None:
    """After this node's tasks succeeded: waits until every node's did, or one failed."""
    while True:
        failure = monitor.check()
        if failure is not None:
            return failure
        try:
            if rendezvous.all_done(generation):
                return None
        except (RuntimeError, OSError) as e:
            return Failure("", 0, 1, f"(node 0's launcher) stopped answering at {rendezvous.master}: {e}")
        time.sleep(0.2)  # remote nodes: the store is the only thing to poll
