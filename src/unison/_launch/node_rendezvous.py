"""The launchers' meeting point for a multi-node job: a TCPStore at the master.

``unison launch --nnodes N`` runs one launcher per node. Node 0's launcher hosts a
``torch.distributed.TCPStore`` at ``--master-addr:--master-port`` (torchrun's habit);
every launcher, node 0 included, connects to it and, once per generation (each start or
restart of the job), publishes where its tasks listen, then waits for every other node.
Node 0 also publishes the generation's fresh cluster key. During the run the store
carries the job's fate: the first failed task (first writer wins), the nodes whose
tasks all finished, and a heartbeat per launcher, so a failure anywhere, or a launcher
that vanished, ends the job on every node.

Keys are prefixed with the generation (``g3/node/1``), so a restart never reads the
previous run's values. Everything waits against a deadline and says which node it
waited for and at which address.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import secrets
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from unison.errors import ClusterError

if TYPE_CHECKING:
    pass

__all__ = ["NodeTasks", "Failure", "NodeRendezvous", "format_address"]

# How often a launcher's heartbeat counter must move before other nodes consider it gone.
_POLL_SECONDS = 0.2


def format_address(host: str, port: int) -> str:
    """``host:port``, with brackets around an IPv6 host."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclasses.dataclass(frozen=True)
class NodeTasks:
    """What one node publishes: its reachable address and its tasks' ports.

    Attributes:
        rank: the node's rank (``--node-rank``).
        address: the host address other nodes reach this node's tasks at.
        tasks: ``(job, index, port)`` for each task this node runs.
        coordinator_port: the coordination store's port (node 0 only, else None).
        store_port: the port of the workers' rendezvous store, which node 0's launcher
            hosts for the generation (node 0 only, else None).
    """

    rank: int
    address: str
    tasks: tuple[tuple[str, int, int], ...]
    coordinator_port: int | None = None
    store_port: int | None = None

    def to_json(self) -> str:
        """The published form."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> NodeTasks:
        """Reads what :meth:`to_json` wrote."""
        data = json.loads(text)
        tasks = tuple((str(job), int(index), int(port)) for job, index, port in data["tasks"])
        return cls(int(data["rank"]), str(data["address"]), tasks, data.get("coordinator_port"), data.get("store_port"))


@dataclasses.dataclass(frozen=True)
class Failure:
    """The job's first failure: which task, on which node, with which exit code."""

    task: str
    node: int
    code: int
    detail: str

    def describe(self) -> str:
        """``"task worker:3 on node 1 exited with code 137 (killed by SIGKILL)"``."""
        return f"task {self.task} on node {self.node} {self.detail}"


class NodeRendezvous:
    """One launcher's connection to the job's store (node 0 hosts it).

    Args:
        nnodes: how many nodes (launchers) the job has.
        node_rank: this node's rank, 0..nnodes-1.
        master_addr, master_port: where node 0 hosts the store.
        timeout: seconds to wait for the store (connecting) and for the other nodes
            (each rendezvous).
        config: settings every node must agree on (compared with node 0's).

    Raises:
        ClusterError: the store cannot be hosted or reached within ``timeout``.
    """

    def __init__(
        self, *, nnodes: int, node_rank: int, master_addr: str, master_port: int, timeout: float, config: dict[str, Any]
    ) -> None:
        self.nnodes, self.node_rank, self.timeout = nnodes, node_rank, timeout
        self.master = format_address(master_addr, master_port)
        self._beats: dict[int, tuple[int, float]] = {}
        self._last_beat = 0.0
        import torch.distributed as dist  # here: a one-node launch never imports torch

        try:
            self._store = dist.TCPStore(
                master_addr,
                master_port,
                None,
                node_rank == 0,
                timeout=datetime.timedelta(seconds=timeout),
                wait_for_workers=False,
            )
        except (RuntimeError, OSError) as e:
            if node_rank == 0:
                raise ClusterError(
                    f"node 0 could not host the rendezvous store at {self.master} ({e}); "
                    f"is --master-port {master_port} free and --master-addr this node's address?"
                ) from e
            raise ClusterError(
                f"node {node_rank} could not reach the rendezvous store at {self.master} within {timeout:g} s ({e}); "
                f"start node 0's launcher with the same --master-addr/--master-port, or raise --rendezvous-timeout"
            ) from e
        self._check_config(config)

    def _check_config(self, config: dict[str, Any]) -> None:
        mine = json.dumps(config, sort_keys=True)
        if self.node_rank == 0:
            self._store.set("config", mine)
            return
        self._wait(["config"], "node 0 to publish the job's settings", missing=[0])
        theirs = json.loads(self._store.get("config"))
        for name, value in config.items():
            if value is not None and theirs.get(name) != value:  # None: a setting only node 0 knows
                raise ClusterError(
                    f"node {self.node_rank} was started with {name}={value!r} "
                    f"but node 0 with {name}={theirs.get(name)!r}; "
                    f"start every node's launcher with the same {name}"
                )

    def _wait(self, keys: Sequence[str], what: str, missing: Sequence[int]) -> None:
        try:
            self._store.wait(list(keys), datetime.timedelta(seconds=self.timeout))
        except (RuntimeError, OSError) as e:
            if "timeout" not in str(e).lower() and "timed out" not in str(e).lower():
                raise ClusterError(
                    f"node {self.node_rank} lost the rendezvous store at {self.master} while waiting for {what} ({e})"
                ) from e
            absent = [rank for rank, key in zip(missing, keys) if not self._store.check([key])]
            names = ", ".join(f"node {rank}" for rank in absent) or "a node"
            raise ClusterError(
                f"node {self.node_rank} waited {self.timeout:g} s at the rendezvous store {self.master} for {what}: "
                f"{names} never arrived; start its launcher (same --master-addr/--master-port, its --node-rank) "
                f"or raise --rendezvous-timeout"
            ) from e

    def join(self, generation: int, mine: NodeTasks) -> tuple[list[NodeTasks], bytes]:
        """Publishes this node's tasks for ``generation`` and waits for every node's.

        Returns:
            Every node's tasks, by node rank, and the generation's cluster key.

        Raises:
            ClusterError: a node did not arrive within the timeout (named), or two
                launchers claimed the same node rank.
        """
        prefix = f"g{generation}/"
        if self._store.add(f"{prefix}claim/{self.node_rank}", 1) != 1:
            raise ClusterError(
                f"two launchers claimed --node-rank {self.node_rank} at {self.master}; "
                f"give each node its own rank in 0..{self.nnodes - 1}"
            )
        if self.node_rank == 0:
            self._store.set(f"{prefix}authkey", secrets.token_bytes(32).hex())
        self._store.set(f"{prefix}node/{self.node_rank}", mine.to_json())
        self.beat(generation, force=True)
        ranks = list(range(self.nnodes))
        self._wait([f"{prefix}node/{rank}" for rank in ranks], f"every node of generation {generation}", missing=ranks)
        self._wait([f"{prefix}authkey"], "node 0's cluster key", missing=[0])
        nodes = [NodeTasks.from_json(self._store.get(f"{prefix}node/{rank}")) for rank in ranks]
        authkey = bytes.fromhex(self._store.get(f"{prefix}authkey").decode())
        self._beats = {rank: (-1, time.monotonic()) for rank in ranks if rank != self.node_rank}
        return nodes, authkey

    def report_failure(self, generation: int, failure: Failure) -> Failure:
        """Records ``failure`` unless another came first; returns the one that counts."""
        key = f"g{generation}/failed"
        text = json.dumps(dataclasses.asdict(failure))
        winner = self._store.compare_set(key, "", text)
        return Failure(**json.loads(winner))

    def failure(self, generation: int) -> Failure | None:
        """The generation's first failure, if any node reported one."""
        key = f"g{generation}/failed"
        if not self._store.check([key]):
            return None
        return Failure(**json.loads(self._store.get(key)))

    def report_done(self, generation: int) -> None:
        """Records that every task of this node finished successfully."""
        self._store.add(f"g{generation}/done", 1)

    def all_done(self, generation: int) -> bool:
        """Whether every node's tasks finished successfully."""
        return self._store.add(f"g{generation}/done", 0) >= self.nnodes

    def beat(self, generation: int, force: bool = False) -> None:
        """Moves this launcher's heartbeat counter (at most every poll interval)."""
        now = time.monotonic()
        if force or now - self._last_beat >= _POLL_SECONDS:
            self._store.add(f"g{generation}/beat/{self.node_rank}", 1)
            self._last_beat = now

    def silent_node(self, generation: int, limit: float) -> int | None:
        """A node whose heartbeat has not moved for ``limit`` seconds, or None."""
        now = time.monotonic()
        for rank, (count, since) in list(self._beats.items()):
            current = self._store.add(f"g{generation}/beat/{rank}", 0)
            if current != count:
                self._beats[rank] = (current, now)
            elif now - since > limit:
                return rank
        return None

    def acknowledge(self, generation: int) -> None:
        """Tells node 0 this launcher read the job's outcome and needs the store no more."""
        self._store.add(f"g{generation}/exited", 1)

    def wait_acknowledged(self, generation: int, limit: float) -> None:
        """Node 0: waits (up to ``limit`` s) until every other launcher read the outcome."""
        deadline = time.monotonic() + limit
        while self._store.add(f"g{generation}/exited", 0) < self.nnodes - 1 and time.monotonic() < deadline:
            time.sleep(_POLL_SECONDS)  # remote launchers: nothing local to wait on
