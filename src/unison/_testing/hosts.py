"""Simulated hosts for multi-node tests: Linux network namespaces with private ``/dev/shm``.

Each simulated host is a network namespace with its own loopback and one address on a
private switch (a bridge in a namespace of its own, so nothing in the machine's own
network namespace changes), and every process started on it also gets a mount namespace
with a fresh tmpfs on ``/dev/shm``: shared memory made on one host cannot be seen from
another, as on real machines. Addresses come from ``10.201.0.0/24`` and exist only
inside the namespaces, so concurrent fixtures cannot collide.

Needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN), ``ip`` and ``unshare``;
:func:`unavailable_reason` says why not where they are missing, for ``pytest.skip``.

Example (a benchmark script, outside pytest)::

    from unison._testing.hosts import SimulatedHosts

    with SimulatedHosts(2, link_rate="1gbit") as hosts:  # link_delay_ms=0.2 needs netem
        procs = [
            hosts.popen(i, [sys.executable, "-m", "unison.launch", "--nnodes", "2",
                            "--node-rank", str(i), "--master-addr", hosts.address(0),
                            "--workers-per-node", "2", "bench.py"])
            for i in range(2)
        ]
        codes = [p.wait(timeout=300) for p in procs]
    # every process in the namespaces is killed and the namespaces are deleted here
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any

__all__ = ["SimulatedHost", "SimulatedHosts", "unavailable_reason", "remove_orphaned_namespaces", "SUBNET"]

#: The private range the fixture assigns its addresses from (``10.201.0.<host + 1>``).
SUBNET = "10.201.0"

_counter = itertools.count()

# Mount a private tmpfs on /dev/shm in a fresh mount namespace, then become the command.
_WITH_PRIVATE_SHM = 'mount -t tmpfs -o "size=$0,mode=1777" tmpfs /dev/shm && exec "$@"'


def unavailable_reason() -> str | None:
    """Why simulated hosts cannot be made on this machine, or None when they can."""
    if not os.path.isdir("/proc/self/ns"):
        return "simulated hosts need Linux namespaces (no /proc/self/ns)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"simulated hosts need the `{tool}` command (iproute2 / util-linux), which is not installed"
    if os.geteuid() != 0:
        return "simulated hosts need root (CAP_NET_ADMIN to make network namespaces, CAP_SYS_ADMIN to mount /dev/shm)"
    probe = f"unison-probe-{os.getpid()}-{next(_counter)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=10)
    if made.returncode != 0:
        return f"this machine does not allow network namespaces: `ip netns add` failed: {made.stderr.strip()}"
    try:
        mounted = subprocess.run(
            [
                "ip", "netns", "exec", probe, "unshare", "--mount", "--propagation", "private",
                "sh", "-c", _WITH_PRIVATE_SHM, "1m", "true",
            ],
            capture_output=True, text=True, timeout=10,
        )
        if mounted.returncode != 0:
            return f"this machine does not allow a private /dev/shm in a mount namespace: {mounted.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "delete", probe], capture_output=True, timeout=10)
    return None


@dataclasses.dataclass(frozen=True)
class SimulatedHost:
    """One simulated host: its network namespace, its address and its ``/dev/shm`` size."""

    index: int
    namespace: str
    address: str
    shm_size: str


class SimulatedHosts:
    """``count`` simulated hosts on one private switch; a context manager.

    Args:
        count: how many hosts (at least 1).
        shm_size: size of each host's private ``/dev/shm`` (tmpfs syntax, e.g. "256m").
        shm_sizes: per-host sizes, overriding ``shm_size`` for the hosts they name
            (``{1: "64k"}`` gives host 1 a ``/dev/shm`` too small for real work).
        link_delay_ms: optional one-way delay added to each host's outgoing link (netem,
            which some kernels lack: RuntimeError then), so the network is slower than
            memory as a real one is.
        link_rate: optional bandwidth limit of each host's outgoing link (tc syntax,
            "1gbit"; tbf alone, netem with a delay).

    Leaving the ``with`` block (or :meth:`close`) kills every process in the hosts'
    namespaces, including ones that made sessions of their own, and deletes the
    namespaces, even when the block raised.
    """

    def __init__(
        self,
        count: int = 2,
        *,
        shm_size: str = "256m",
        shm_sizes: Mapping[int, str] | None = None,
        link_delay_ms: float | None = None,
        link_rate: str | None = None,
    ) -> None:
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= 200:
            raise ValueError(f"count={count!r} is not a number of hosts in 1..200; pass e.g. count=2")
        tag = f"{os.getpid()}x{next(_counter)}"
        self._switch = f"unison-{tag}-sw"
        self._bridge = "br0"
        self._tag = tag
        self.hosts = [
            SimulatedHost(i, f"unison-{tag}-h{i}", f"{SUBNET}.{i + 1}", dict(shm_sizes or {}).get(i, shm_size))
            for i in range(count)
        ]
        self._delay, self._rate = link_delay_ms, link_rate
        self._processes: list[subprocess.Popen[Any]] = []
        self._made: list[str] = []
        self._closed = False

    def __enter__(self) -> SimulatedHosts:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _ip(self, *args: str, namespace: str | None = None) -> None:
        command = ["ip", *args] if namespace is None else ["ip", "-n", namespace, *args]
        done = subprocess.run(command, capture_output=True, text=True, timeout=10)
        if done.returncode != 0:
            raise RuntimeError(f"`{' '.join(command)}` failed: {done.stderr.strip()}")

    def _build(self) -> None:
        remove_orphaned_namespaces()
        self._ip("netns", "add", self._switch)
        self._made.append(self._switch)
        self._ip("link", "add", self._bridge, "type", "bridge", namespace=self._switch)
        self._ip("link", "set", self._bridge, "up", namespace=self._switch)
        for host in self.hosts:
            self._ip("netns", "add", host.namespace)
            self._made.append(host.namespace)
            self._ip("link", "set", "lo", "up", namespace=host.namespace)
            # The pair is made inside the host's namespace; its far end moves to the switch.
            self._ip(
                "link", "add", "eth0", "type", "veth", "peer", "name", f"port{host.index}", namespace=host.namespace
            )
            self._ip("link", "set", f"port{host.index}", "netns", self._switch, namespace=host.namespace)
            self._ip("addr", "add", f"{host.address}/24", "dev", "eth0", namespace=host.namespace)
            self._ip("link", "set", "eth0", "up", namespace=host.namespace)
            self._ip("link", "set", f"port{host.index}", "master", self._bridge, namespace=self._switch)
            self._ip("link", "set", f"port{host.index}", "up", namespace=self._switch)
            if self._delay is not None or self._rate is not None:
                self._shape(host)

    def _shape(self, host: SimulatedHost) -> None:
        if shutil.which("tc") is None:
            raise RuntimeError("link_delay_ms/link_rate need the `tc` command (iproute2), which is not installed")
        if self._delay is not None:
            qdisc = ["netem", "delay", f"{self._delay}ms"] + (["rate", self._rate] if self._rate is not None else [])
        else:  # a rate alone: tbf, which more kernels have than netem
            qdisc = ["tbf", "rate", str(self._rate), "burst", "256kb", "latency", "50ms"]
        command = ["ip", "netns", "exec", host.namespace, "tc", "qdisc", "add", "dev", "eth0", "root", *qdisc]
        done = subprocess.run(command, capture_output=True, text=True, timeout=10)
        if done.returncode != 0:
            hint = ""
            if "unknown" in done.stderr and self._delay is not None:
                hint = (
                    " (this kernel has no netem qdisc, sch_netem: link_delay_ms cannot be simulated;"
                    " link_rate alone uses tbf)"
                )
            raise RuntimeError(f"`{' '.join(command)}` failed: {done.stderr.strip()}{hint}")

    def address(self, host: int) -> str:
        """The address of host ``host`` on the switch (reachable from every host)."""
        return self.hosts[host].address

    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        """``argv`` made to run on host ``host``: in its network namespace, with its own ``/dev/shm``."""
        h = self.hosts[host]
        return [
            "ip", "netns", "exec", h.namespace,
            "unshare", "--mount", "--propagation", "private",
            "sh", "-c", _WITH_PRIVATE_SHM, h.shm_size, *argv,
        ]  # fmt: skip

    def popen(
        self,
        host: int,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        stdout: int | IO[Any] | None = subprocess.PIPE,
        stderr: int | IO[Any] | None = subprocess.STDOUT,
        cwd: str | os.PathLike[str] | None = None,
        text: bool = True,
    ) -> subprocess.Popen[Any]:
        """Starts ``argv`` on host ``host`` (see :meth:`command`) in a session of its own.

        Output is piped (stdout and stderr together, as text) unless told otherwise.
        """
        if self._closed:
            raise RuntimeError("these simulated hosts are closed; make new ones")
        process = subprocess.Popen(
            self.command(host, argv), env=None if env is None else dict(env), stdin=subprocess.DEVNULL,
            stdout=stdout, stderr=stderr, cwd=cwd, text=text, start_new_session=True,
        )  # fmt: skip
        self._processes.append(process)
        return process

    def run(
        self, host: int, argv: Sequence[str], *, timeout: float = 30.0, **kwargs: Any
    ) -> subprocess.CompletedProcess[str]:
        """Runs ``argv`` on host ``host`` to completion; its output is returned as text."""
        process = self.popen(host, argv, **kwargs)
        try:
            out, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._kill_namespace_processes(self.hosts[host].namespace)
            process.communicate()
            raise
        return subprocess.CompletedProcess(process.args, process.returncode, out, None)

    def pids(self, host: int) -> list[int]:
        """Process ids of every process running in host ``host``'s network namespace."""
        return _namespace_pids(self.hosts[host].namespace)

    def _kill_namespace_processes(self, namespace: str, deadline_s: float = 10.0) -> None:
        deadline = time.monotonic() + deadline_s
        while pids := _namespace_pids(namespace):
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes {pids} in namespace {namespace} survived SIGKILL for {deadline_s:g} s")
            time.sleep(0.02)  # the kernel reaps them asynchronously; poll until they are gone

    def close(self) -> None:
        """Kills every process on every host and deletes the namespaces (idempotent)."""
        if self._closed:
            return
        self._closed = True
        errors = []
        for namespace in reversed(self._made):
            try:
                self._kill_namespace_processes(namespace)
            except RuntimeError as e:
                errors.append(str(e))
        for process in self._processes:
            if process.poll() is None:
                _kill_group(process.pid)
            try:
                process.communicate(timeout=10)
            except (subprocess.TimeoutExpired, ValueError):
                pass
        for namespace in reversed(self._made):
            done = subprocess.run(["ip", "netns", "delete", namespace], capture_output=True, text=True, timeout=10)
            if done.returncode != 0:
                errors.append(f"`ip netns delete {namespace}` failed: {done.stderr.strip()}")
        self._made.clear()
        if errors:
            raise RuntimeError("tearing down the simulated hosts failed: " + "; ".join(errors))


def remove_orphaned_namespaces() -> list[str]:
    """Deletes the namespaces (and their processes) of simulated hosts whose maker died.

    A test process killed outright cannot tear its hosts down; the next one to make
    hosts does it. Returns the names removed.
    """
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    removed = []
    for line in listed.splitlines():
        name = line.split()[0] if line.split() else ""
        match = re.fullmatch(r"unison-(\d+)x\d+-(?:h\d+|sw)", name)
        if match is None or os.path.exists(f"/proc/{match.group(1)}"):
            continue
        for pid in _namespace_pids(name):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=10)
        removed.append(name)
    return removed


def _namespace_pids(namespace: str) -> list[int]:
    done = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, timeout=10)
    me = os.getpid()
    return [int(p) for p in done.stdout.split() if p.isdigit() and int(p) != me]


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
