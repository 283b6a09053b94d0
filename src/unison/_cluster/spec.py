"""ClusterSpec: the jobs of a cluster and the network address of each task.

A cluster is a set of named jobs ("chief", "worker", "ps", "evaluator"); each job has
tasks numbered 0..N-1, and each task has a ``"host:port"`` address. The spec is
immutable, validated once when built, and compared by value, so resolvers, the
coordinator and strategies can pass it around without defensive copies.
"""

from __future__ import annotations

import functools
import ipaddress
import re
import socket
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

__all__ = ["ClusterSpec", "split_address", "ClusterLike"]

_HOST = re.compile(r"^[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?$")
_IPV6 = re.compile(r"^\[(?P<host>[0-9A-Fa-f:.]+(?:%[\w.-]+)?)\]:(?P<port>[^:]*)$")
_JOB = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")


def split_address(address: str, *, field: str = "address") -> tuple[str, int]:
    """Splits ``"host:port"`` (or ``"[v6-host]:port"``) into ``(host, port)``.

    Args:
        address: the address to split.
        field: how the caller names the address in error messages.

    Returns:
        The host (without IPv6 brackets) and the port as an int in 1..65535.

    Raises:
        ValueError: if ``address`` is not a string of that form.
    """
    if not isinstance(address, str):
        raise ValueError(
            f"{field} {address!r} is a {type(address).__name__}, not a 'host:port' string; "
            f"fix `{field}`, e.g. '127.0.0.1:2222'"
        )
    v6 = _IPV6.match(address)
    if v6:
        host, port_text = v6.group("host"), v6.group("port")
    else:
        host, sep, port_text = address.rpartition(":")
        if not sep or not _HOST.match(host):
            raise ValueError(
                f"{field} {address!r} is not a 'host:port' address; fix `{field}`, "
                f"e.g. '10.0.0.1:2222', 'node-1:2222' or '[::1]:2222'"
            )
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ValueError(
            f"{field} {address!r} has port {port_text!r}, which is not an integer in 1..65535; "
            f"fix the port of `{field}`"
        )
    return host, int(port_text)


_LOOPBACK = "this machine's loopback interface"
_LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})


def _endpoint(address: str) -> tuple[str, int]:
    """The endpoint an address names, so that one endpoint spelled two ways is found.

    Every loopback spelling (``localhost``, ``127.x.x.x``, ``::1``, an IPv4-mapped
    loopback, and this machine's host name where it resolves to loopback, as Debian's
    ``127.0.1.1`` does) is this machine, where a port can serve one task: servers bind
    all interfaces (``0.0.0.0``) as often as the named one. Other names are compared
    case-insensitively and IP literals in their canonical form; other names are not
    looked up, so building a spec never waits on DNS.
    """
    host, port = split_address(address)
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        name = host.lower().rstrip(".")
        if name in _LOOPBACK_NAMES or name.endswith(".localhost") or _is_own_loopback_name(name):
            return _LOOPBACK, port
        return name, port
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return (_LOOPBACK if ip.is_loopback else str(ip)), port


def _is_own_loopback_name(name: str) -> bool:
    """Whether ``name`` is this machine's host name and resolves only to loopback addresses."""
    own = socket.gethostname().lower()
    if name != own and name != own.split(".")[0]:
        return False
    return _resolves_to_loopback(name)


@functools.lru_cache(maxsize=8)
def _resolves_to_loopback(name: str) -> bool:
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    addresses = {ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos}
    return bool(addresses) and all(
        a.is_loopback
        or (isinstance(a, ipaddress.IPv6Address) and a.ipv4_mapped is not None and a.ipv4_mapped.is_loopback)
        for a in addresses
    )


def _task_list(job: str, tasks: Any) -> tuple[str, ...]:
    """Validates one job's tasks (a list, or a dict of index -> address) into a dense tuple."""
    where = f"cluster job {job!r}"
    if isinstance(tasks, (str, bytes)) or not isinstance(tasks, (Sequence, Mapping)):
        raise ValueError(
            f"{where} is {tasks!r}, not a list of 'host:port' addresses; "
            f"fix `cluster.{job}`, e.g. ['10.0.0.1:2222']"
        )
    if isinstance(tasks, Mapping):
        by_index: dict[int, Any] = {}
        for key, address in tasks.items():
            text = str(key)
            if isinstance(key, bool) or not (isinstance(key, int) or text.isdigit()) or int(text) < 0:
                raise ValueError(
                    f"{where} has task index {key!r}, which is not a non-negative integer; "
                    f"fix the keys of `cluster.{job}`"
                )
            by_index[int(text)] = address
        missing = sorted(set(range(len(by_index))) - set(by_index))
        if missing:
            raise ValueError(
                f"{where} has task indices {sorted(by_index)!r}, missing {missing!r}: indices must "
                f"be 0..N-1 without gaps (they become ranks); fix the keys of `cluster.{job}`"
            )
        tasks = [by_index[i] for i in range(len(by_index))]
    if len(tasks) == 0:
        raise ValueError(
            f"{where} is empty ({tasks!r}): a job needs at least one task; give its addresses "
            f"or remove `cluster.{job}`"
        )
    for index, address in enumerate(tasks):
        split_address(address, field=f"cluster.{job}[{index}]")
    return tuple(tasks)


class ClusterSpec:
    """The jobs of a cluster and the address of each of their tasks.

    Built from a mapping of job name to either a list of ``"host:port"`` strings or a
    dict of task index to address (JSON keys such as ``"0"`` are accepted), or from
    another ClusterSpec. An empty mapping is the empty cluster of local training, and
    the spec is then falsy.

    tf.distribute equivalent: ``tf.train.ClusterSpec``. Differences: addresses are
    checked to be ``host:port``, task indices must be dense (0..N-1, because they become
    process ranks), no endpoint may appear twice, even spelled two ways (``localhost:2222``
    and ``127.0.0.1:2222``: every loopback spelling is this machine), and the spec is
    immutable and hashable.

    Example:
        >>> spec = ClusterSpec({"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]})
        >>> spec.num_tasks("worker"), spec.task_address("worker", 1)
        (2, '127.0.0.1:2223')

    Raises:
        TypeError: if ``cluster`` is not a mapping or a ClusterSpec.
        ValueError: for a bad job name, an empty job, a gap in task indices, a malformed
            address or an endpoint used twice; the message names the fields and tasks.
    """

    __slots__ = ("_jobs",)

    def __init__(self, cluster: ClusterLike | None = None):
        if cluster is None:
            cluster = {}
        if isinstance(cluster, ClusterSpec):
            self._jobs: dict[str, tuple[str, ...]] = dict(cluster._jobs)
            return
        if not isinstance(cluster, Mapping):
            raise TypeError(
                f"cluster must be a dict of job name -> addresses or a ClusterSpec, got "
                f"{type(cluster).__name__}: {cluster!r}"
            )
        jobs: dict[str, tuple[str, ...]] = {}
        owner: dict[tuple[str, int], tuple[str, str]] = {}  # endpoint -> (field, address)
        for job in sorted(cluster, key=str):
            if not isinstance(job, str) or not _JOB.match(job):
                raise ValueError(
                    f"cluster has job name {job!r}, which is not a name like 'worker'; "
                    f"fix the keys of `cluster`"
                )
            jobs[job] = _task_list(job, cluster[job])
            for index, address in enumerate(jobs[job]):
                here = f"cluster.{job}[{index}]"
                endpoint = _endpoint(address)
                if endpoint in owner:
                    _raise_shared_endpoint(owner[endpoint], (here, address), endpoint)
                owner[endpoint] = (here, address)
        self._jobs = jobs

    @property
    def jobs(self) -> list[str]:
        """The job names, sorted."""
        return list(self._jobs)

    def as_dict(self) -> dict[str, list[str]]:
        """A new dict of job name -> list of addresses (index order)."""
        return {job: list(tasks) for job, tasks in self._jobs.items()}

    def _job(self, job: str) -> tuple[str, ...]:
        try:
            return self._jobs[job]
        except KeyError:
            raise ValueError(f"no job {job!r} in the cluster; its jobs are {self.jobs!r}") from None

    def num_tasks(self, job: str) -> int:
        """Number of tasks of ``job``. Raises ValueError if the cluster has no such job."""
        return len(self._job(job))

    def task_indices(self, job: str) -> list[int]:
        """The task indices of ``job``: ``[0, ..., num_tasks(job) - 1]``."""
        return list(range(len(self._job(job))))

    def job_tasks(self, job: str) -> list[str]:
        """The addresses of ``job``'s tasks, in index order."""
        return list(self._job(job))

    def task_address(self, job: str, index: int) -> str:
        """The ``"host:port"`` of task ``index`` of ``job``.

        Raises:
            ValueError: if the job does not exist or ``index`` is out of range.
        """
        tasks = self._job(job)
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(tasks):
            raise ValueError(
                f"task index {index!r} is out of range: cluster has {len(tasks)} {job!r} tasks "
                f"(valid 0..{len(tasks) - 1})"
            )
        return tasks[index]

    def __iter__(self) -> Iterator[str]:
        return iter(self._jobs)

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ClusterSpec):
            return self._jobs == other._jobs
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self._jobs.items()))

    def __repr__(self) -> str:
        return f"ClusterSpec({self.as_dict()!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (ClusterSpec, (self.as_dict(),))


def _raise_shared_endpoint(first: tuple[str, str], second: tuple[str, str], endpoint: tuple[str, int]) -> None:
    (first_field, first_address), (second_field, second_address) = first, second
    tasks = f"tasks {_task_name(first_field)} and {_task_name(second_field)}"
    if first_address == second_address:
        raise ValueError(
            f"cluster address {first_address!r} is given to both `{first_field}` and `{second_field}` "
            f"({tasks}): every task needs its own host:port; fix one of them"
        )
    host, port = endpoint
    raise ValueError(
        f"cluster addresses {first_address!r} of `{first_field}` and {second_address!r} of `{second_field}` are "
        f"one endpoint ({host if host == _LOOPBACK else repr(host)}, port {port}), so {tasks} would share it: "
        f"every task needs its own host:port; give one of them another port"
    )


def _task_name(field: str) -> str:
    """``cluster.worker[1]`` -> ``worker:1``."""
    job, _, index = field.removeprefix("cluster.").partition("[")
    return f"{job}:{index.rstrip(']')}"


ClusterLike = ClusterSpec | Mapping[str, Sequence[str] | Mapping[Any, str]]
