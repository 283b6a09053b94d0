"""Cluster from the variables torchrun (torch.distributed.run) sets for each process.

torchrun gives every process ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``
and ``MASTER_PORT``; it does not publish the other processes' addresses. The cluster
is therefore ``WORLD_SIZE`` workers where worker 0 is the rendezvous point
``MASTER_ADDR:MASTER_PORT`` (the collective leader's address, as unison's strategies
expect) and worker ``i`` is named ``MASTER_ADDR:MASTER_PORT+i``: those other addresses
identify tasks and are not listened on by unison in INDEPENDENT_WORKER mode.
"""

from __future__ import annotations

import os
import typing
from collections.abc import Mapping

from unison import _devices as devices
from unison._cluster.base import ClusterResolver, task_master_url
from unison._cluster.scheduler import RendezvousKind, Scheduler
from unison._cluster.spec import ClusterSpec, split_address

__all__ = ["TorchrunClusterResolver", "TorchrunScheduler", "TORCHRUN", "TORCHRUN_VARIABLES"]

#: The variables this resolver needs, all set by torchrun for each process.
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _int_var(environ: Mapping[str, str], name: str, low: int, high: int | None = None) -> int:
    text = environ[name]
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < low or (high is not None and value > high):
        bound = f"{low}..{high}" if high is not None else f">= {low}"
        raise ValueError(f"torchrun variable {name}={text!r} is not an integer {bound}; fix `{name}`")
    return value


@typing.final
class TorchrunScheduler(Scheduler):
    """torchrun's conventions: ``LOCAL_RANK``, its own store (``env://``), one thread per
    process already set by torchrun, and ``--max-restarts`` to restart."""

    @property
    def name(self) -> str:
        return "torchrun"

    def local_rank(self, environ: Mapping[str, str]) -> int | None:
        text = environ.get("LOCAL_RANK", "")
        return int(text) if text.strip().isdigit() else None

    def rendezvous_token(self, environ: Mapping[str, str]) -> str:
        return ""

    def rendezvous_kind(self) -> RendezvousKind:
        return RendezvousKind.TORCHRUN

    def cpu_share(self, environ: Mapping[str, str], tasks_on_host: int) -> int | None:
        return None

    def restart_advice(self) -> str:
        return "Restart the workers with torchrun's `--max-restarts=N` and resume from the last checkpoint."


#: The one instance of :class:`TorchrunScheduler`.
TORCHRUN = TorchrunScheduler()


class TorchrunClusterResolver(ClusterResolver):
    """Resolves the cluster from torchrun's environment variables.

    Every process is a "worker"; its task id is ``RANK`` and ``LOCAL_RANK`` picks its
    device on the host. No tf.distribute equivalent (TensorFlow has no torchrun).

    Args:
        rpc_layer: protocol for master URLs (default ``"tcp"``, so ``master(task_id=0)``
            is a torch.distributed ``init_method``).
        environ: the environment to read (default: ``os.environ`` at each call).

    Raises:
        ValueError: (from every accessor) if a variable is missing or malformed, or
            ``RANK`` is not below ``WORLD_SIZE``.
    """

    def __init__(self, rpc_layer: str | None = "tcp", *, environ: Mapping[str, str] | None = None):
        self._rpc_layer = rpc_layer
        self._environ = environ

    @staticmethod
    def is_present(environ: Mapping[str, str] | None = None) -> bool:
        """Whether torchrun's ``RANK`` and ``WORLD_SIZE`` are set."""
        environ = os.environ if environ is None else environ
        return "RANK" in environ and "WORLD_SIZE" in environ

    def _read(self) -> tuple[int, int, int, str, int]:
        environ = os.environ if self._environ is None else self._environ
        missing = [name for name in TORCHRUN_VARIABLES if name not in environ]
        if missing:
            raise ValueError(
                f"torchrun environment is incomplete: {missing!r} not set (need "
                f"{list(TORCHRUN_VARIABLES)!r}); run under torchrun or set them"
            )
        world_size = _int_var(environ, "WORLD_SIZE", 1)
        rank = _int_var(environ, "RANK", 0)
        if rank >= world_size:
            raise ValueError(
                f"torchrun variable RANK={rank} is out of range for WORLD_SIZE={world_size} "
                f"(valid 0..{world_size - 1}); fix `RANK`"
            )
        local_rank = _int_var(environ, "LOCAL_RANK", 0)
        port = _int_var(environ, "MASTER_PORT", 1, 65535)
        host = environ["MASTER_ADDR"]
        split_address(f"[{host}]:{port}" if ":" in host else f"{host}:{port}", field="MASTER_ADDR:MASTER_PORT")
        if port + world_size - 1 > 65535:
            raise ValueError(
                f"torchrun MASTER_PORT={port} leaves no room to name {world_size} tasks "
                f"(ports up to {port + world_size - 1}); fix `MASTER_PORT` (use one <= {65536 - world_size})"
            )
        return rank, world_size, local_rank, host, port

    def cluster_spec(self) -> ClusterSpec:
        _, world_size, _, host, port = self._read()
        host = f"[{host}]" if ":" in host else host
        return ClusterSpec({"worker": [f"{host}:{port + i}" for i in range(world_size)]})

    @property
    def task_type(self) -> str:
        self._read()
        return "worker"

    @property
    def task_id(self) -> int:
        return self._read()[0]

    @property
    def local_rank(self) -> int:
        """``LOCAL_RANK``: this process's index on its host, which picks its CUDA device."""
        return self._read()[2]

    @property
    def rpc_layer(self) -> str | None:
        return self._rpc_layer

    @property
    def environment(self) -> str:
        return TORCHRUN.name

    @property
    def scheduler(self) -> Scheduler:
        return TORCHRUN

    def num_accelerators(self, task_type: str | None = None, task_id: int | None = None) -> dict[str, int]:
        """One CUDA device per process (``cuda:LOCAL_RANK``) when the host has CUDA, else 0."""
        has_cuda = any(devices.is_cuda(d) for d in devices.local_devices())
        return {"GPU": 1 if has_cuda else 0}

    def master(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        rpc_layer: str | None = None,
    ) -> str:
        return task_master_url(self, task_type, task_id, rpc_layer)
