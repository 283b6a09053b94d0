"""The distribute coordinator: runs ``worker_fn`` on every worker of a cluster.

Two modes, as in the reference:

* ``INDEPENDENT_WORKER``: every task runs the same program, which calls
  ``run_distribute_coordinator``; each task learns its role from ``TF_CONFIG``. Chief
  and workers run ``worker_fn``, the evaluator runs ``eval_fn``, ps tasks serve until
  the leader tells them to stop (see ``coordinator.rendezvous_store``).
* ``STANDALONE_CLIENT``: every task runs a standard server; one client process, which
  knows the cluster, sends ``worker_fn`` to each chief/worker task and ``eval_fn`` to
  the evaluator, relays the worker barrier, and returns every task's result.

Without a cluster, both run ``worker_fn`` (then ``eval_fn``) locally.

tf.distribute equivalent: ``distribute_coordinator.run_distribute_coordinator``.
"""

from __future__ import annotations

import datetime
import enum
import threading
from collections.abc import Callable, Mapping
from typing import Any

from unison._cluster import multi_worker_util
from unison._cluster.spec import ClusterLike, ClusterSpec, split_address
from unison._cluster.tf_config import resolve_task
from unison._coordinator.channel import connect, require_authkey
from unison._coordinator.rendezvous_store import StoreCoordination
from unison._coordinator.standard_server import RunRequest, StandardServer
from unison._coordinator.worker_context import WorkerContext, run_in_worker_context
from unison.errors import ClusterError

__all__ = ["CoordinatorMode", "run_distribute_coordinator"]

_DEFAULT_TIMEOUT = 1800.0


class CoordinatorMode(str, enum.Enum):
    """How the distribute coordinator runs (``tf.distribute`` ``CoordinatorMode``)."""

    #: One client sends ``worker_fn`` to standard servers running on every task.
    STANDALONE_CLIENT = "standalone_client"
    #: Every task runs the coordinator itself and does its own part.
    INDEPENDENT_WORKER = "independent_worker"


def run_distribute_coordinator(
    worker_fn: Callable[[Any], Any],
    strategy: Any,
    eval_fn: Callable[[Any], Any] | None = None,
    eval_strategy: Any = None,
    mode: CoordinatorMode | str = CoordinatorMode.STANDALONE_CLIENT,
    cluster_spec: ClusterLike | None = None,
    task_type: str | None = None,
    task_id: int | None = None,
    rpc_layer: str | None = "tcp",
    *,
    authkey: bytes | None = None,
    timeout_seconds: float = _DEFAULT_TIMEOUT,
    environ: Mapping[str, str] | None = None,
) -> Any:
    """Runs ``worker_fn(strategy)`` on the workers of a cluster, each in its worker context.

    ``strategy`` must offer ``configure(cluster_spec=None, task_type=None, task_id=None)``
    (in STANDALONE_CLIENT mode also a ``rendezvous=None`` keyword: the ``host:port`` of the
    store the client opens for the workers' process group, whose leader address its
    standard server holds) and ``extended.experimental_between_graph`` /
    ``should_checkpoint`` / ``should_save_summary`` / ``experimental_should_init``; each
    task gets a configured copy. Inside ``worker_fn``, ``get_current_worker_context()`` describes the task.
    Without ``eval_fn``, an evaluator task runs ``worker_fn``.

    The cluster comes from ``cluster_spec`` or ``TF_CONFIG``; the task from
    ``task_type``/``task_id`` or ``TF_CONFIG``'s ``task`` (explicit arguments win over
    ``TF_CONFIG``, unlike the reference, where ``TF_CONFIG``'s task wins).

    Args:
        worker_fn: the training function, called with the configured strategy.
        strategy: the strategy to configure for each chief/worker task.
        eval_fn: the evaluator's function (default ``worker_fn``).
        eval_strategy: the evaluator's strategy (configured with no cluster), or None.
        mode: ``CoordinatorMode`` or its value as a string.
        cluster_spec: the cluster (dict or ClusterSpec); default from ``TF_CONFIG``.
        task_type: this task's type; None or "client" for a standalone client.
        task_id: this task's index.
        rpc_layer: protocol of master targets (``TF_CONFIG``'s ``rpc_layer`` wins).
        authkey: the cluster's key for STANDALONE_CLIENT (default from the environment).
        timeout_seconds: longest wait for a server, a barrier or the end of the run.
        environ: environment to read ``TF_CONFIG`` and keys from (default ``os.environ``).

    Returns:
        Locally: ``worker_fn``'s result. INDEPENDENT_WORKER: this task's function's
        result (None on a task that only served). STANDALONE_CLIENT client:
        ``{"chief": [...], "worker": [r0, r1, ...], "evaluator": [...]}`` with each task's
        result in index order (under in-graph replication, ``worker_fn``'s result);
        STANDALONE_CLIENT task: None after its standard server is stopped.

    Raises:
        ValueError: for a malformed cluster, ``TF_CONFIG``, mode, or a missing key.
        ClusterError: if a task fails (the message names it; the remote exception is the
            cause) or cannot be reached.
    """
    try:
        mode = CoordinatorMode(mode)
    except ValueError:
        valid = [m.value for m in CoordinatorMode]
        raise ValueError(f"unknown coordinator mode {mode!r}; use one of {valid!r}") from None
    independent = mode is CoordinatorMode.INDEPENDENT_WORKER
    cluster = resolve_task(cluster_spec, task_type, task_id, rpc_layer, require_task=independent, environ=environ)
    spec, task_type, task_id, rpc_layer = cluster.spec, cluster.task_type, cluster.task_id, cluster.rpc_layer
    if not spec:  # local training; the mode does not matter
        result = run_in_worker_context(worker_fn, strategy, None, None, None, rpc_layer)
        if eval_fn is not None:
            run_in_worker_context(eval_fn, eval_strategy, None, None, None, rpc_layer)
        return result
    eval_fn = eval_fn or worker_fn
    if task_type is not None and task_id is not None:
        if independent:
            return _run_independent_worker(
                worker_fn, strategy, eval_fn, eval_strategy, spec, task_type, task_id, rpc_layer, timeout_seconds,
                environ,
            )
        # A task of a standalone-client cluster: serve until stopped.
        server = StandardServer(spec, task_type, task_id, authkey=authkey, rpc_layer=rpc_layer, environ=environ)
        server.start().join()
        return None
    key = require_authkey(authkey, environ)
    return _run_client(worker_fn, strategy, eval_fn, eval_strategy, spec, rpc_layer, key, timeout_seconds)


def _run_independent_worker(
    worker_fn: Callable[[Any], Any],
    strategy: Any,
    eval_fn: Callable[[Any], Any],
    eval_strategy: Any,
    spec: ClusterSpec,
    task_type: str,
    task_id: int,
    rpc_layer: str | None,
    timeout: float,
    environ: Mapping[str, str] | None,
) -> Any:
    if task_type == "evaluator":
        return run_in_worker_context(eval_fn, eval_strategy, spec, task_type, task_id, rpc_layer)
    between_graph = bool(strategy.extended.experimental_between_graph)
    chief_and_workers = multi_worker_util.task_count(spec, "chief") + multi_worker_util.task_count(spec, "worker")
    num_ps = multi_worker_util.task_count(spec, "ps")
    # Under in-graph replication only the chief runs worker_fn; the other workers serve.
    num_workers = chief_and_workers if between_graph else 1
    num_servers = num_ps + (chief_and_workers - num_workers)
    runs_fn = task_type in ("chief", "worker") and (
        between_graph or WorkerContext(strategy, spec, task_type, task_id).is_chief
    )
    coordination = None
    if num_workers + num_servers > 1:
        coordination = StoreCoordination.open(
            spec, task_type, task_id, num_workers=num_workers, num_servers=num_servers, timeout=timeout, environ=environ
        )
    if not runs_fn:
        if strategy is not None and task_type == "ps":
            # A ps strategy may need its task configured to serve (e.g. join its RPC group).
            run_in_worker_context(lambda s: None, strategy, spec, task_type, task_id, rpc_layer)
        if coordination is not None:
            coordination.serve_until_stopped()
        return None
    try:
        if between_graph:
            result = run_in_worker_context(worker_fn, strategy, spec, task_type, task_id, rpc_layer, coordination)
        else:
            result = run_in_worker_context(worker_fn, strategy, spec, None, None, rpc_layer)
    except BaseException:
        if coordination is not None:
            coordination.abort(f"{task_type}:{task_id}")  # release the others' waits at once
        raise
    if coordination is not None:
        coordination.check_out()
    return result


def _run_client(
    worker_fn: Callable[[Any], Any],
    strategy: Any,
    eval_fn: Callable[[Any], Any],
    eval_strategy: Any,
    spec: ClusterSpec,
    rpc_layer: str | None,
    authkey: bytes,
    timeout: float,
) -> Any:
    """The standalone client: one thread per task, each driving that task's server."""
    cluster = spec.as_dict()
    between_graph = bool(strategy.extended.experimental_between_graph)
    jobs = [job for job in ("chief", "worker") if job in spec.jobs] if between_graph else []
    tasks: list[tuple[str, int]] = [(job, i) for job in jobs for i in range(spec.num_tasks(job))]
    if "evaluator" in spec.jobs:
        tasks.append(("evaluator", 0))
    barrier = threading.Barrier(sum(1 for job, _ in tasks if job != "evaluator") or 1, timeout=timeout)
    outcomes: dict[tuple[str, int], tuple[str, Any]] = {}
    store, rendezvous = _rendezvous_store(spec, timeout) if jobs else (None, None)

    def drive(job: str, index: int) -> None:
        evaluator = job == "evaluator"
        request = RunRequest(
            eval_fn if evaluator else worker_fn,
            eval_strategy if evaluator else strategy,
            cluster,
            job,
            index,
            rpc_layer,
            use_barrier=not evaluator,
            rendezvous=None if evaluator else rendezvous,
        )
        try:
            outcomes[(job, index)] = (
                "ok", _drive_task(spec.task_address(job, index), authkey, request, barrier, timeout)
            )
        except BaseException as e:
            outcomes[(job, index)] = ("error", e)
            if not evaluator:
                barrier.abort()  # release workers waiting for this one

    threads = [threading.Thread(target=drive, args=task, name=f"unison-client-{task[0]}:{task[1]}") for task in tasks]
    for thread in threads:
        thread.start()
    in_graph_result = None
    try:
        if not between_graph:
            in_graph_result = run_in_worker_context(worker_fn, strategy, spec, None, None, rpc_layer)
    finally:
        for thread in threads:
            thread.join()
        del store  # the workers are done with their rendezvous
    failed = [(task, outcome[1]) for task, outcome in outcomes.items() if outcome[0] == "error"]
    if failed:
        lines = [(f"{job}:{index}", (str(error).splitlines() or [repr(error)])[0]) for (job, index), error in failed]
        summary = "; ".join(line if line.startswith(name) else f"{name}: {line}" for name, line in lines)
        first = failed[0][1]  # the earliest failure, usually the cause of the others
        raise ClusterError(f"{len(failed)} task(s) failed: {summary}") from first
    if not between_graph:
        return in_graph_result
    results: dict[str, list[Any]] = {}
    for (job, _index), outcome in sorted(outcomes.items()):
        results.setdefault(job, []).append(outcome[1])
    return results


def _rendezvous_store(spec: ClusterSpec, timeout: float) -> tuple[Any, str]:
    """Opens the store the workers' process group meets at, on a free port of the client.

    The workers reach the client at the loopback address when the whole cluster is on
    this machine, else at this host's address.
    """
    import socket

    import torch.distributed as dist

    hosts = {split_address(address)[0] for job in spec.jobs for address in spec.job_tasks(job)}
    local = all(h in ("localhost", "::1") or h.startswith("127.") for h in hosts)
    host = "127.0.0.1" if local else socket.gethostbyname(socket.getfqdn())
    store = dist.TCPStore(host, 0, None, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout))
    return store, f"{host}:{store.port}"


def _drive_task(address: str, authkey: bytes, request: RunRequest, barrier: threading.Barrier, timeout: float) -> Any:
    """Sends one task its work, serves its barrier requests, and returns its result."""
    name = f"{request.task_type}:{request.task_id}"
    channel = connect(address, authkey, timeout)
    try:
        channel.send(("run", request))
        while True:
            message = channel.recv()
            if message[0] == "barrier":
                try:
                    barrier.wait()
                    channel.send(("barrier_ok", message[1]))
                except threading.BrokenBarrierError:
                    channel.send(("barrier_broken", "another worker failed or the barrier timed out"))
            elif message[0] == "result":
                return message[1]
            elif message[0] == "error":
                _, error, remote_traceback = message
                detail = f"\n--- traceback on {name} ---\n{remote_traceback}" if remote_traceback else ""
                raise ClusterError(f"{name} at {address} failed: {type(error).__name__}: {error}{detail}") from error
            else:
                raise ClusterError(f"{name} at {address} sent an unknown message {message[0]!r}")
    except (EOFError, OSError) as e:
        raise ClusterError(
            f"lost the connection to {name} at {address} while it ran: the server stopped or crashed"
        ) from e
    finally:
        channel.close()
