"""Test harness for multi-process tests of unison (private: not part of the public API).

* :func:`run_workers` runs a function in fresh processes, one per rank, with a
  rendezvous store served by the test process, and reports failures and hangs as
  rank-tagged :class:`WorkerFailure` / :class:`WorkerTimeout` with stacks.
* :class:`WorkerPool` keeps warm processes with a gloo group for small collective tests.
* :func:`connect_rendezvous_store` / :func:`init_test_process_group` form groups inside
  workers; :func:`free_port` is only for address strings that are never bound.
* :mod:`unison._testing.leaks` backs the leak-checking fixture in ``tests/conftest.py``.

Example:
    >>> from unison._testing import run_workers  # doctest: +SKIP
    >>> run_workers(lambda rank, world_size: rank * 2, world_size=2)  # doctest: +SKIP
    [0, 2]
"""

from __future__ import annotations

from unison._testing.pool import WorkerPool
from unison._testing.rendezvous import (
    RENDEZVOUS_ENV,
    as_launched_worker,
    connect_rendezvous_store,
    free_port,
    init_test_process_group,
)
from unison._testing.results import WorkerFailure, WorkerResult, WorkerTimeout
from unison._testing.workers import run_workers

__all__ = [
    "RENDEZVOUS_ENV",
    "WorkerFailure",
    "WorkerPool",
    "WorkerResult",
    "WorkerTimeout",
    "as_launched_worker",
    "connect_rendezvous_store",
    "free_port",
    "init_test_process_group",
    "run_workers",
]
