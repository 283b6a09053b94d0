"""HybridParameterServerStrategy: dense layers all-reduced every step, embedding rows on ps tasks.

Recommendation models are a few MB of dense layers beside embedding tables far larger
than a worker. This strategy trains the dense part exactly as MultiWorkerMirroredStrategy
does (the same replicas, buckets and collective all-reduce among the chief and workers:
dense parameters are bit-equal on every worker after every step), while every
``DynamicEmbedding`` made in its scope keeps its rows on the cluster's ps tasks (row
``id`` on ps task ``shard_of(id, M)``): a worker pulls the rows of its batch in forward
and pushes their gradients in ``optimizer.step()``, asynchronously, with the row
optimizer that its ``torch.optim`` optimizer maps to (Adagrad's state kept beside each row
on the ps).

Semantics:
- **Pulls and pushes.** ``step()`` sends a push without waiting. Every worker pushes once
  per global step and names it (``RemoteTable(synchronous=True)``); a ps task holds a step's
  pushes until every worker's has come and applies their sum once, so a row that several
  workers touched takes one optimizer step with the gradient of the global batch, as on one
  device (applied one after the other, two Adagrad steps differ from one: measured on the
  DLRM example, 0.0015-0.0064 of held-out AUC). A worker's pull at step ``t`` waits until the
  ps task applied step ``t - 1``, so it sees every worker's pushes before it: the rows are
  one device's on the global batch, up to the order of floating-point sums (the wait is
  short: the dense all-reduce of step ``t - 1`` has every worker's push of it under way).
  Each ps task gathers the workers' pulls of a step and looks their ids up as one lookup (as
  one device looks up the global batch: one call's fixed cost instead of one per worker).
  Under ``--ps-in-workers`` a worker posts its pull of the ps task in its own process before
  it waits for the others' replies and takes its rows after them, so its process's session
  threads look it up with the other workers' pulls meanwhile.
  ``join_pushes()`` waits for every worker's pushes (before a checkpoint or evaluation).
  The shard's clock moves once per global step: eviction's steps, last-seen steps and
  SparseAdam's step count ``t`` are one device's on the global batch. A worker that stops
  pushing makes the others' pulls fail after ``0.8 * timeout_seconds``, naming the step.
  The table policies run on the ps tasks as on one device: admission by each id's count (the
  global step that reaches the count makes the row), a time to live in seconds by the ps
  task's clock, and a capacity of ``ceil(N / M)`` rows per shard after each global step.
  With the mean reduction (the default) a worker's row gradients are divided by
  ``num_replicas_in_sync``, so the summed update is the one a single device would make on
  the global batch.
- **Checkpoints.** ``state_dict()`` of a module holds the dense parameters (the chief
  saves them, as under MWMS) and the whole table, read from the ps tasks (ids, rows,
  optimizer state, counters). ``load_state_dict`` on every worker: the chief replaces
  the rows on the ps tasks (re-split for their number), and every worker waits for it
  before training goes on.
- **Faults.** A lost worker ends the job as under MWMS; with ``unison launch
  --max-restarts K`` the workers start again while the ps tasks keep running with their
  rows (``unison._launch.kept_ps``), and the restarted workers find the tables they made
  (a table is created once, by whichever worker comes first). Restarted without a
  checkpoint, they count their steps from 0 again: a ps task applies the pushes of steps
  its clock has passed one by one as they come, until the count catches up with it.
  A lost ps task raises ``ParameterServerError`` naming ``ps:K`` within the timeout.

Run it with ``unison launch --workers N --ps M train.py``: ps tasks call
``unison.Server(resolver).join()``, workers build the strategy. On one host,
``--ps-in-workers`` runs no ps processes: each worker serves its share of the ps tasks in its
own process and reaches its own without a socket (``unison._ps.task_server``; less CPU a
step, but a lost worker loses its rows). With ``--bind-cores`` too, each worker runs on a core
of its own, where its ps session thread runs the moment its main thread waits (the DLRM
example 1.15x faster on 2 cores: ``benchmarks/RESULTS.md``).

tf.distribute equivalent: none in core TensorFlow (users combine Horovod with PS by
hand; Persia's hybrid design). Fixed-size ``nn.Embedding``/``nn.EmbeddingBag`` tables
stay replicated unless marked (``unison.embeddings.on_ps(module)``) or selected by size
(``unison.embeddings.tables_on_ps(model, min_bytes)``) in the scope: then their rows move
to the ps tasks as a ``DynamicEmbedding`` with the same rows.
"""

from __future__ import annotations

import atexit
import dataclasses
import typing
from collections.abc import Sequence

import torch

from unison._cluster.base import ClusterResolver
from unison._cluster.detect import detect_cluster_resolver
from unison._collectives.ops.collective import CollectiveAllReduce
from unison._collectives.options import CommunicationOptions
from unison._coordinator.channel import require_authkey
from unison._devices import canonicalize_all
from unison._ps.task_server import HostedPS
from unison._ps.wire.client import PSClient
from unison._ps.worker.remote_table import RemoteTables
from unison._reduce import ReduceOp
from unison._strategies.base import Strategy
from unison._strategies.multi_worker import collective_components, default_devices

__all__ = ["HybridParameterServerStrategy"]

_STEP_WAIT_SHARE = 0.8
"""A lookup waits for the other workers' pushes of the steps before it this share of the timeout: the ps
task's error naming the missing step reaches the worker before the worker gives up on the ps task."""


@typing.final
class HybridParameterServerStrategy(Strategy):
    """MultiWorkerMirrored dense training with ``DynamicEmbedding`` rows on the cluster's ps tasks.

    Example (every worker; ps tasks run ``unison.Server(resolver).join()``)::

        strategy = unison.HybridParameterServerStrategy()
        with strategy.scope():
            model = DLRM(...)                 # its DynamicEmbedding rows live on the ps tasks
            opt = torch.optim.Adagrad(model.parameters(), lr=0.05)

    Args:
        cluster_resolver: the cluster, with 'worker' (and optionally 'chief') and 'ps'
            jobs; default: detected (``TF_CONFIG`` as ``unison launch`` sets it).
        communication_options: the dense all-reduce's packing, timeout and backend.
        timeout_seconds: how long a ps task may fail to answer before the error.
        authkey: the cluster's key (default: ``UNISON_AUTHKEY``/``UNISON_AUTHKEY_FILE``).
        devices: this worker's replica devices (default: as MultiWorkerMirroredStrategy).

    Raises:
        ValueError: for a cluster without ps tasks or workers, for a ps or evaluator task,
            or a bad timeout.
    """

    def __init__(self, cluster_resolver: ClusterResolver | None = None,
                 communication_options: CommunicationOptions | None = None, *, timeout_seconds: float = 30.0,
                 authkey: bytes | None = None, devices: Sequence[str | torch.device] | None = None):
        if communication_options is not None and not isinstance(communication_options, CommunicationOptions):
            raise TypeError(f"communication_options must be a CommunicationOptions, "
                            f"got {type(communication_options).__name__}")
        if isinstance(timeout_seconds, bool) or not isinstance(timeout_seconds, (int, float)) or timeout_seconds <= 0:
            raise ValueError(f"timeout_seconds must be a positive number, got {timeout_seconds!r}")
        self._resolver = detect_cluster_resolver(cluster_resolver)
        cluster = self._resolver.resolve()
        jobs = self._resolver.cluster_spec().as_dict()
        if cluster.is_local or not jobs.get("ps"):
            raise ValueError(f"HybridParameterServerStrategy needs a cluster with 'ps' tasks for the embedding rows, "
                             f"got jobs {sorted(jobs) if jobs else 'none'}; run it with `unison launch --workers N "
                             f"--ps M train.py` (or use MultiWorkerMirroredStrategy without ps tasks)")
        if cluster.task_type not in ("chief", "worker"):
            raise ValueError(f"HybridParameterServerStrategy trains on 'chief' and 'worker' tasks, got task_type "
                             f"{cluster.task_type!r}; run `unison.Server(resolver).join()` on ps tasks")
        self._ps_addresses = tuple(jobs["ps"])
        self._timeout = float(timeout_seconds)
        self._authkey = authkey
        self._client: PSClient | None = None
        # first: the other workers may reach the ps tasks served here as soon as they are up
        self._hosted = HostedPS.for_task(jobs, cluster.task_type, cluster.task_id, require_authkey(authkey))
        trainers = len(jobs.get("chief", ())) + len(jobs.get("worker", ()))
        if self._hosted is not None:
            atexit.register(self._stop_hosting, trainers - 1)
        options = communication_options or CommunicationOptions()
        chosen = canonicalize_all(devices) if devices is not None else default_devices(cluster)
        tables = RemoteTables(len(self._ps_addresses), self._ps_client, prefix="hybrid:",
                              grad_scale=self._row_grad_scale, after_load=self._barrier,
                              writer=lambda: self.extended.components.cluster.is_chief, synchronous=True,
                              pushers=trainers, step_wait_s=_STEP_WAIT_SHARE * self._timeout)
        super().__init__(dataclasses.replace(collective_components(self, cluster, chosen, options), tables=tables))

    @property
    def cluster_resolver(self) -> ClusterResolver:
        """The resolver the cluster came from."""
        return self._resolver

    @property
    def ps_addresses(self) -> tuple[str, ...]:
        """The ps tasks that hold the embedding rows."""
        return self._ps_addresses

    def _ps_client(self) -> PSClient:
        if self._client is None:
            self._client = PSClient(self._ps_addresses, require_authkey(self._authkey), timeout=self._timeout,
                                    reply_timeout=self._timeout)
        return self._client

    def _stop_hosting(self, peers: int) -> None:
        """At exit, a worker serving ps tasks: closes its own connections, then serves on until
        every other trainer is done with its ps tasks (``unison._ps.task_server``)."""
        if self._client is not None:
            self._client.close()
        assert self._hosted is not None
        self._hosted.stop_after_peers(peers, self._timeout)

    def _row_grad_scale(self) -> float:
        if self.extended.gradient_reduce_op == ReduceOp.MEAN:
            return 1.0 / self.num_replicas_in_sync
        return 1.0

    def _barrier(self) -> None:
        ops = self.extended.components.cross_device_ops
        if isinstance(ops, CollectiveAllReduce):
            ops.barrier()

    def join_pushes(self) -> None:
        """Blocks until every worker's row pushes so far are applied on the ps tasks.

        A push is sent by ``optimizer.step()`` without waiting for the ps tasks (this
        worker's next lookup waits for it): call this on every worker before a
        checkpoint or an evaluation reads the tables. Each worker waits for its own
        pushes, then all meet at a barrier.
        """
        if self._client is not None:
            self._client.settle()
        self._barrier()

    def __reduce__(self) -> tuple:
        raise TypeError("HybridParameterServerStrategy holds connections to this worker's group and ps tasks; "
                        "build it in each worker's program instead of pickling it")

    def __repr__(self) -> str:
        return f"HybridParameterServerStrategy(replicas={self.num_replicas_in_sync}, ps={len(self._ps_addresses)})"
