"""A real parameter-server cluster for tests: worker and ps Servers in processes of their own
(forked from the harness's fork server, which imported torch once).

Each server binds 127.0.0.1 port 0 and reports its address through a pipe; the test
process is the coordinator (the chief).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import secrets
import signal
from collections.abc import Iterator

import unison
from unison._testing._procs import worker_context


def _serve(job: str, index: int, bind: str, key_hex: str, conn) -> None:
    import torch

    torch.set_num_threads(1)
    os.environ["UNISON_AUTHKEY"] = key_hex
    # Placeholder addresses: only this task's own entry matters, and it binds `bind` instead.
    placeholder = {job: [f"127.0.0.1:{i + 1}" for i in range(index + 1)]}
    server = unison.Server(placeholder, job, index, bind_address=bind)
    # SIGTERM stops serving, as the chief's shutdown does: `join` returns and the process exits 0
    # after closing its sessions (a test that never shut its servers down ends them this way).
    signal.signal(signal.SIGTERM, lambda signum, frame: server.stop())
    conn.send(server.address)
    conn.close()
    server.join()


class Cluster:
    """Processes of a test cluster and the resolver the coordinator uses."""

    def __init__(self, key_hex: str):
        self.key_hex = key_hex
        self.procs: dict[str, multiprocessing.Process] = {}
        self.addresses: dict[str, str] = {}

    def start(self, job: str, index: int, bind: str = "127.0.0.1:0") -> None:
        ctx = worker_context()
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(job, index, bind, self.key_hex, child), daemon=True)
        proc.start()
        child.close()
        self.procs[f"{job}:{index}"] = proc
        self._pending = getattr(self, "_pending", []) + [(f"{job}:{index}", parent)]

    def wait_started(self, timeout: float = 30.0) -> None:
        for name, conn in self._pending:
            if not conn.poll(timeout):
                raise TimeoutError(f"{name} did not start within {timeout} s")
            self.addresses[name] = conn.recv()
            conn.close()
        self._pending = []

    def resolver(self, num_workers: int, num_ps: int) -> unison.SimpleClusterResolver:
        spec = unison.ClusterSpec({
            "chief": ["127.0.0.1:1"],
            "worker": [self.addresses[f"worker:{i}"] for i in range(num_workers)],
            "ps": [self.addresses[f"ps:{i}"] for i in range(num_ps)],
        })
        return unison.SimpleClusterResolver(spec, task_type="chief", task_id=0)

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)

    def stop(self, timeout: float = 10.0) -> dict[str, int | None]:
        """Waits for servers told to stop (the coordinator's shutdown); kills one still running
        after ``timeout`` s. Returns the exit codes."""
        codes = {}
        for name, proc in self.procs.items():
            proc.join(timeout)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
            codes[name] = proc.exitcode
        return codes

    def end(self, timeout: float = 10.0) -> dict[str, int | None]:
        """Asks every server still running to stop now (SIGTERM), then as :meth:`stop`.

        For the end of a test: a server nobody shut down (workers of the hybrid strategy never
        shut their ps tasks down) otherwise cost the test the whole ``timeout`` before it was killed.
        """
        for proc in self.procs.values():
            if proc.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGTERM)
        return self.stop(timeout)


@contextlib.contextmanager
def ps_cluster(num_workers: int = 2, num_ps: int = 2) -> Iterator[Cluster]:
    """Starts the servers; on exit every process still running is asked to stop (killed if still
    running after 10 s)."""
    key_hex = secrets.token_hex(32)
    os.environ["UNISON_AUTHKEY"] = key_hex  # the coordinator's key (the autouse fixture restores os.environ)
    cluster = Cluster(key_hex)
    try:
        for i in range(num_ps):
            cluster.start("ps", i)
        for i in range(num_workers):
            cluster.start("worker", i)
        cluster.wait_started()
        yield cluster
    finally:
        cluster.end()
