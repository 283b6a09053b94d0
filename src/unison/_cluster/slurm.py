"""Cluster from the variables SLURM sets for each task of a job step (``srun``).

SLURM names the step's hosts in a compressed list (``node[001-003,007],gpu-a[1-2]``),
the tasks per host in a run-length form (``2(x3),1``), and each task's global rank in
``SLURM_PROCID``. Tasks are laid out in SLURM's default block order: the first host
runs ranks 0..k-1, and so on. Task ``j`` on a host is named ``host:port_base + j``.

Ports and hosts, in order of precedence:

- ``port_base`` passed to the resolver; else ``MASTER_PORT`` when set; else a port
  derived from ``SLURM_JOB_ID`` and ``SLURM_STEP_ID`` (:func:`rendezvous_port`), so two
  jobs, or two ``srun`` steps of one job, that share a node rendezvous on different
  ports (a fixed port made the second one fail or, worse, join the first's store);
- ``MASTER_ADDR``, when set, replaces the name of the step's first host (where rank 0
  runs) in the cluster, for nodes whose SLURM names do not resolve from the others.

A Python program started by an ``sbatch`` script without ``srun`` sees
``SLURM_PROCID=0`` and ``SLURM_NTASKS`` of the allocation but no step: it is one
process, not the job's tasks, and is told at once to run under ``srun``.
"""

from __future__ import annotations

import itertools
import os
import re
import typing
from collections.abc import Mapping

from unison import _devices as devices
from unison._cluster import multi_worker_util, threads
from unison._cluster.base import ClusterResolver, task_master_url
from unison._cluster.scheduler import RendezvousKind, Scheduler
from unison._cluster.spec import ClusterSpec
from unison.errors import ClusterError

__all__ = ["SlurmClusterResolver", "SlurmScheduler", "SLURM", "expand_hostlist", "expand_tasks_per_node",
           "rendezvous_port", "job_step", "PORT_LOW", "PORT_SLOTS", "PORT_STRIDE"]

#: Derived rendezvous ports lie in ``PORT_LOW .. PORT_LOW + PORT_SLOTS * PORT_STRIDE - 1``
#: (20000..59999): above the usual services (Jupyter 8888, TensorBoard 6006) and below
#: Linux's ephemeral range (32768+ is shared, but a listener there is rare and named).
PORT_LOW = 20000
#: Number of port windows a job step can be given.
PORT_SLOTS = 2500
#: Ports per window: task ``j`` of a host is named ``port + j`` and the coordination
#: store takes the leader's port + 1, so a window serves up to 15 tasks per host.
PORT_STRIDE = 16

_GROUP = re.compile(r"\[([^\[\]]*)\]")
_COUNT = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def _split_top_level(text: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        if depth < 0 or depth > 1:
            raise ValueError(f"SLURM host list {text!r} has unbalanced or nested brackets at char {i}")
        if char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"SLURM host list {text!r} has an unclosed '['")
    items.append(text[start:])
    return items


def _expand_group(group: str, text: str) -> list[str]:
    names: list[str] = []
    for part in group.split(","):
        first, dash, last = part.partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"SLURM host list {text!r} has range {part!r}, which is not N or N-M")
        low, high = int(first), int(last) if dash else int(first)
        if low > high:
            raise ValueError(f"SLURM host list {text!r} has range {part!r} that runs backwards")
        names.extend(str(n).zfill(len(first)) for n in range(low, high + 1))
    return names


def expand_hostlist(text: str) -> list[str]:
    """Expands a SLURM host list into host names, in order.

    ``"node[001-003,007],login1"`` -> ``["node001", "node002", "node003", "node007",
    "login1"]``. Zero padding follows the first number of each range, and several
    bracket groups in one name expand as a product (``"r[1-2]n[1-2]"`` gives 4 hosts).

    Raises:
        ValueError: on unbalanced brackets, an empty name or a malformed range.
    """
    hosts: list[str] = []
    for item in _split_top_level(text.strip()):
        literals = _GROUP.split(item)  # literal, group, literal, group, ..., literal
        if not item or any("[" in s or "]" in s for s in literals[::2]):
            raise ValueError(f"SLURM host list {text!r} has an empty or malformed entry {item!r}")
        choices = [[s] if i % 2 == 0 else _expand_group(s, text) for i, s in enumerate(literals)]
        hosts.extend("".join(parts) for parts in itertools.product(*choices))
    return hosts


def expand_tasks_per_node(text: str) -> list[int]:
    """Expands SLURM's tasks-per-node form: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``.

    Raises:
        ValueError: if an entry is not ``N`` or ``N(xM)``.
    """
    counts: list[int] = []
    for part in text.strip().split(","):
        match = _COUNT.match(part.strip())
        if not match:
            raise ValueError(f"SLURM tasks per node {text!r} has entry {part!r}, which is not N or N(xM)")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def rendezvous_port(job_id: int, step_id: int) -> int:
    """The first port of a SLURM job step's window: distinct for steps 0..15 of one job
    and for consecutive job ids.

    ``PORT_LOW + ((job_id * 16 + step_id) % PORT_SLOTS) * PORT_STRIDE``: like Lightning's
    ``15000 + last digits of the job id`` it needs no coordination, and it adds the step,
    so concurrent ``srun`` steps of one allocation do not meet on one port. Two steps
    share a window only when ``job_id * 16 + step_id`` agree modulo 2500; the store's
    job/step token then turns the clash into an error instead of a wrong rendezvous.

    Example:
        >>> rendezvous_port(1234, 0), rendezvous_port(1234, 1), rendezvous_port(1235, 0)
        (55904, 55920, 56160)

    Raises:
        ValueError: if an id is negative.
    """
    if job_id < 0 or step_id < 0:
        raise ValueError(f"SLURM job id {job_id!r} and step id {step_id!r} must be non-negative")
    return PORT_LOW + ((job_id * 16 + step_id) % PORT_SLOTS) * PORT_STRIDE


def _first(environ: Mapping[str, str], *names: str) -> str | None:
    for name in names:
        if name in environ:
            return environ[name]
    return None


def _step_id(environ: Mapping[str, str]) -> str | None:
    return _first(environ, "SLURM_STEP_ID", "SLURM_STEPID")


def job_step(environ: Mapping[str, str]) -> tuple[int, int]:
    """``(SLURM_JOB_ID, SLURM_STEP_ID)`` as integers; a step that is not a number (SLURM's
    ``batch``/``extern`` steps, or none) counts as step 0.

    Raises:
        ValueError: if ``SLURM_JOB_ID`` is not set or not a number.
    """
    job = _first(environ, "SLURM_JOB_ID", "SLURM_JOBID")
    if job is None or not job.strip().isdigit():
        raise ValueError(
            f"SLURM_JOB_ID={job!r} is not a job number, so no rendezvous port can be derived from it; "
            f"run inside `srun`, or set MASTER_PORT (or pass port_base)"
        )
    step = (_step_id(environ) or "").strip()
    return int(job), int(step) if step.isdigit() else 0


@typing.final
class SlurmScheduler(Scheduler):
    """SLURM's conventions inside ``srun``: ``SLURM_LOCALID``, a store token naming the job
    step, a CPU share where ``srun`` sets no threads, and ``srun -K`` plus a requeue to
    restart."""

    @property
    def name(self) -> str:
        return "slurm"

    def local_rank(self, environ: Mapping[str, str]) -> int | None:
        text = environ.get("SLURM_LOCALID", "")
        return int(text) if text.strip().isdigit() else None

    def rendezvous_token(self, environ: Mapping[str, str]) -> str:
        """``slurm-job<SLURM_JOB_ID>-step<SLURM_STEP_ID>`` ("?" for an id that is not set)."""
        job = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID") or "?"
        step = environ.get("SLURM_STEP_ID") or environ.get("SLURM_STEPID") or "?"
        return f"slurm-job{job.strip()}-step{step.strip()}"

    def rendezvous_kind(self) -> RendezvousKind:
        return RendezvousKind.LEADER

    def cpu_share(self, environ: Mapping[str, str], tasks_on_host: int) -> int | None:
        """``SLURM_CPUS_PER_TASK`` (``srun -c``) when it is a positive integer, else this
        process's usable CPUs divided by the cluster's tasks on its host."""
        text = environ.get("SLURM_CPUS_PER_TASK", "").strip()
        return threads.cpu_share(int(text) if text.isdigit() and int(text) > 0 else None, tasks_on_host)

    def restart_advice(self) -> str:
        return ("Run the step with `srun --kill-on-bad-exit=1` (`srun -K`) so the other tasks stop too, and "
                "requeue the job (`sbatch --requeue`, or `scontrol requeue $SLURM_JOB_ID`) to resume from the "
                "last checkpoint.")


#: The one instance of :class:`SlurmScheduler`.
SLURM = SlurmScheduler()


class SlurmClusterResolver(ClusterResolver):
    """Resolves the cluster from SLURM's variables inside ``srun``.

    Reads ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS`` (or ``SLURM_NTASKS``),
    ``SLURM_STEP_NODELIST`` (or ``SLURM_JOB_NODELIST``/``SLURM_NODELIST``),
    ``SLURM_STEP_TASKS_PER_NODE`` (or ``SLURM_TASKS_PER_NODE``; without it tasks are
    spread evenly), ``SLURM_JOB_ID`` and ``SLURM_STEP_ID`` (the rendezvous port and the
    store's job/step token), and ``MASTER_ADDR``/``MASTER_PORT`` when set (see the
    module docstring for their precedence).

    tf.distribute equivalent: ``tf.distribute.cluster_resolver.SlurmClusterResolver``.
    Differences: it does not set ``CUDA_VISIBLE_DEVICES`` (the strategy picks devices),
    and the port is derived from the job step instead of a fixed 8888.

    Args:
        jobs: job name -> number of tasks, assigned to ranks in this order (default
            ``{"worker": ntasks}``), e.g. ``{"ps": 1, "worker": 3}``.
        port_base: port of the first task on each host; task j on a host uses
            ``port_base + j`` (default: ``MASTER_PORT``, else :func:`rendezvous_port`
            of the job step).
        gpus_per_node: CUDA devices per host (default: the devices this host sees).
        gpus_per_task: CUDA devices per task (default: per node // tasks on this node).
        rpc_layer: protocol for master URLs.
        environ: the environment to read (default: ``os.environ`` at each call).

    Raises:
        ValueError: (from the accessors) for an incomplete or inconsistent environment.
        ClusterError: (from the accessors) for a program of an ``sbatch`` script run
            without ``srun`` while the job has several tasks.
    """

    def __init__(
        self,
        jobs: Mapping[str, int] | None = None,
        port_base: int | None = None,
        gpus_per_node: int | None = None,
        gpus_per_task: int | None = None,
        rpc_layer: str | None = "tcp",
        *,
        environ: Mapping[str, str] | None = None,
    ):
        if port_base is not None and (isinstance(port_base, bool) or not isinstance(port_base, int)
                                      or not 1 <= port_base <= 65535):
            raise ValueError(f"port_base {port_base!r} is not a port in 1..65535; fix `port_base`")
        if jobs is not None:
            for job, count in jobs.items():
                if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                    raise ValueError(f"jobs[{job!r}] is {count!r}, not a positive task count; fix `jobs`")
        self._jobs = dict(jobs) if jobs is not None else None
        self._port_base = port_base
        self._gpus_per_node = gpus_per_node
        self._gpus_per_task = gpus_per_task
        self._rpc_layer = rpc_layer
        self._environ = environ

    @staticmethod
    def is_present(environ: Mapping[str, str] | None = None) -> bool:
        """Whether this process is a SLURM task (``SLURM_PROCID`` and a task count are set)."""
        environ = os.environ if environ is None else environ
        return "SLURM_PROCID" in environ and _first(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS") is not None

    def _env(self) -> Mapping[str, str]:
        return os.environ if self._environ is None else self._environ

    def _layout(self) -> tuple[int, list[str], list[int]]:
        """(rank, host of each rank, local index of each rank)."""
        environ = self._env()
        found = {
            "SLURM_PROCID": environ.get("SLURM_PROCID"),
            "SLURM_NTASKS": _first(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"),
            "SLURM_NODELIST": _first(environ, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"),
        }
        raw = {name: value for name, value in found.items() if value is not None}
        missing = [name for name in found if name not in raw]
        if missing:
            raise ValueError(f"SLURM environment is incomplete: {missing!r} not set; run inside `srun`")
        for name in ("SLURM_PROCID", "SLURM_NTASKS"):
            if not raw[name].strip().isdigit():
                raise ValueError(f"SLURM variable {name}={raw[name]!r} is not a non-negative integer")
        rank, ntasks = int(raw["SLURM_PROCID"]), int(raw["SLURM_NTASKS"])
        if ntasks > 1 and _step_id(environ) is None:
            raise ClusterError(
                f"this process sees SLURM_PROCID={rank} and SLURM_NTASKS={ntasks} but no job step "
                f"(SLURM_STEP_ID is not set): it was started by the batch script itself, as one process, "
                f"not as the job's {ntasks} tasks, and would wait for partners that never come; run it under "
                f"`srun` (e.g. `srun python train.py` in the sbatch script), or pass cluster_resolver='local' "
                f"to train alone"
            )
        hosts = expand_hostlist(raw["SLURM_NODELIST"])
        per_node_text = _first(environ, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
        if per_node_text is not None:
            per_node = expand_tasks_per_node(per_node_text)
        elif ntasks % len(hosts) == 0:
            per_node = [ntasks // len(hosts)] * len(hosts)
        else:
            raise ValueError(
                f"SLURM_NTASKS={ntasks} does not divide over {len(hosts)} hosts and "
                f"SLURM_TASKS_PER_NODE is not set; set it"
            )
        if len(per_node) != len(hosts) or sum(per_node) != ntasks:
            raise ValueError(
                f"SLURM layout does not add up: hosts {hosts!r}, tasks per node {per_node!r}, "
                f"SLURM_NTASKS={ntasks}"
            )
        if rank >= ntasks:
            raise ValueError(f"SLURM_PROCID={rank} is out of range for SLURM_NTASKS={ntasks} (valid 0..{ntasks - 1})")
        master_addr = environ.get("MASTER_ADDR", "").strip()
        if master_addr:
            hosts[0] = master_addr  # the first host runs rank 0: its name may not resolve elsewhere
        rank_hosts = [h for h, n in zip(hosts, per_node) for _ in range(n)]
        local = [j for n in per_node for j in range(n)]
        return rank, rank_hosts, local

    def port_base(self) -> int:
        """The port of the first task on each host (``port_base``, ``MASTER_PORT`` or derived).

        Raises:
            ValueError: if ``MASTER_PORT`` is not a port, or neither it nor
                ``SLURM_JOB_ID`` is set to derive one.
        """
        if self._port_base is not None:
            return self._port_base
        environ = self._env()
        text = environ.get("MASTER_PORT", "").strip()
        if text:
            if not text.isdigit() or not 1 <= int(text) <= 65535:
                raise ValueError(f"MASTER_PORT={text!r} is not a port in 1..65535; fix or unset `MASTER_PORT`")
            return int(text)
        return rendezvous_port(*job_step(environ))

    def _jobs_for(self, ntasks: int) -> dict[str, int]:
        jobs = self._jobs if self._jobs is not None else {"worker": ntasks}
        if sum(jobs.values()) != ntasks:
            raise ValueError(
                f"jobs {jobs!r} ask for {sum(jobs.values())} tasks but SLURM runs {ntasks}; "
                f"fix `jobs` or the number of tasks of the step"
            )
        return jobs

    def _task_of(self, rank: int, ntasks: int) -> tuple[str, int]:
        start = 0
        for job, count in self._jobs_for(ntasks).items():
            if rank < start + count:
                return job, rank - start
            start += count
        raise AssertionError("unreachable: ranks are checked against the job sizes")

    def cluster_spec(self) -> ClusterSpec:
        _, rank_hosts, local = self._layout()
        base = self.port_base()
        addresses = [f"[{h}]:{base + j}" if ":" in h else f"{h}:{base + j}" for h, j in zip(rank_hosts, local)]
        if base + max(local) > 65535:
            raise ValueError(f"port_base {base} + {max(local)} tasks per host passes 65535; lower `port_base`")
        cluster, start = {}, 0
        for job, count in self._jobs_for(len(addresses)).items():
            cluster[job] = addresses[start : start + count]
            start += count
        return multi_worker_util.validate_cluster_spec(cluster, None, None)

    @property
    def task_type(self) -> str:
        rank, rank_hosts, _ = self._layout()
        return self._task_of(rank, len(rank_hosts))[0]

    @property
    def task_id(self) -> int:
        rank, rank_hosts, _ = self._layout()
        return self._task_of(rank, len(rank_hosts))[1]

    @property
    def rpc_layer(self) -> str | None:
        return self._rpc_layer

    @property
    def environment(self) -> str:
        return SLURM.name

    @property
    def scheduler(self) -> Scheduler:
        return SLURM

    def num_accelerators(self, task_type: str | None = None, task_id: int | None = None) -> dict[str, int]:
        if self._gpus_per_task is not None:
            return {"GPU": self._gpus_per_task}
        per_node = self._gpus_per_node
        if per_node is None:
            per_node = sum(devices.is_cuda(d) for d in devices.local_devices())
        rank, rank_hosts, _ = self._layout()
        tasks_here = rank_hosts.count(rank_hosts[rank])
        return {"GPU": per_node // tasks_here}

    def master(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        rpc_layer: str | None = None,
    ) -> str:
        return task_master_url(self, task_type, task_id, rpc_layer)
