"""The environment variables that describe a cluster to unison, and their readers.

Every variable unison reads or writes to form a cluster is named here once, so the
launcher that sets them and the resolvers that read them cannot drift apart; the
readers below are the only code that reads unison's own variables (the rest of unison
gets their values from a ``ResolvedCluster`` or from these functions). Scheduler-owned
variables (torchrun's ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``..., SLURM's ``SLURM_*``) are
read by their own resolver and its scheduler (``torchrun.py``, ``slurm.py``), and
``OMP_NUM_THREADS`` (whether the user chose a thread count) here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = [
    "PREEMPTED_EXIT_CODE",
    "TF_CONFIG",
    "UNISON_AUTHKEY",
    "UNISON_AUTHKEY_FILE",
    "UNISON_COORDINATOR_PORT",
    "UNISON_RESTART_COUNT",
    "UNISON_RENDEZVOUS",
    "UNISON_PREEMPTION_NOTICES",
    "UNISON_PS_SHARED_MEMORY",
    "UNISON_PS_SCHED_BATCH",
    "UNISON_PS_IN_WORKERS",
    "UNISON_TERMINAL",
    "MIN_KEY_BYTES",
    "read_authkey",
    "rendezvous_address",
    "restart_count",
    "coordinator_port",
    "thread_setting",
    "ps_shared_memory",
    "ps_sched_batch",
    "ps_in_workers",
    "terminal_streams",
]

#: JSON cluster description, in TensorFlow's format: ``{"cluster": {...}, "task": {...}}``.
TF_CONFIG = "TF_CONFIG"

#: The cluster's control-channel key, as hex (at least 16 bytes). Set by ``unison launch``.
UNISON_AUTHKEY = "UNISON_AUTHKEY"

#: Path of a file holding the control-channel key as hex; the alternative to ``UNISON_AUTHKEY``
#: for schedulers that mount secrets as files.
UNISON_AUTHKEY_FILE = "UNISON_AUTHKEY_FILE"

#: Port, on the collective leader's host, of the INDEPENDENT_WORKER coordination store
#: (worker barrier, end-of-run check-out, ps stop). Unset: the leader's port + 1.
UNISON_COORDINATOR_PORT = "UNISON_COORDINATOR_PORT"

#: How many times ``unison launch`` has restarted the cluster before this run ("0" first).
UNISON_RESTART_COUNT = "UNISON_RESTART_COUNT"

#: ``host:port`` of an existing TCPStore for the workers' process group, used instead of
#: hosting one at the collective leader's address (set by test harnesses and by the
#: coordinator's standalone client, whose leader port is taken by its standard server).
UNISON_RENDEZVOUS = "UNISON_RENDEZVOUS"

#: "0" on a worker keeps all its parameter-server traffic on the sockets, even with a ps
#: task on its host (comparisons; hosts whose ``/proc`` hides a worker's memory files).
UNISON_PS_SHARED_MEMORY = "UNISON_PS_SHARED_MEMORY"

#: "0" on a ps task keeps its sessions' threads at the default CPU scheduling policy instead of ``SCHED_BATCH``
#: (``unison._ps.task.scheduling``: a request arriving then never preempts a worker on its host).
UNISON_PS_SCHED_BATCH = "UNISON_PS_SCHED_BATCH"

#: "1" (set by ``unison launch --ps-in-workers``): no process runs the ps tasks; worker ``i``
#: serves ps task ``j`` in its own process for every ``j % num_workers == i``
#: (``unison._ps.task_server``). Unset or "0": the ps tasks are processes of their own.
UNISON_PS_IN_WORKERS = "UNISON_PS_IN_WORKERS"

#: A directory (set by ``unison launch``) where a task that receives a preemption signal
#: leaves a file naming itself, so the launcher names the task(s) the notice went to, not
#: whichever task happened to exit first with ``PREEMPTED_EXIT_CODE``.
UNISON_PREEMPTION_NOTICES = "UNISON_PREEMPTION_NOTICES"

#: Which of the launcher's streams are terminals, set by ``unison launch`` for its tasks:
#: ``"stdout,stderr"``, one of them, or ``""``. A task's own streams are pipes to the
#: launcher, so this is how ``unison.progress.track`` knows to draw a live bar.
UNISON_TERMINAL = "UNISON_TERMINAL"

#: The exit code of a task that saved and left after a preemption signal (EX_TEMPFAIL):
#: ``unison launch`` reports it as a preemption and restarts the cluster when it may.
#: Defined here, beside the variables, as the other half of the launcher's contract with
#: its tasks (``checkpoint.preemption`` exits with it; the launcher reads it without torch).
PREEMPTED_EXIT_CODE = 75


#: The shortest control-channel key accepted, in bytes.
MIN_KEY_BYTES = 16


def _environ(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def _parse_key(text: str, source: str) -> bytes:
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        raise ValueError(
            f"{source} is not a hex string; fix it "
            f"(e.g. `python -c \"import secrets; print(secrets.token_hex(32))\"`)"
        ) from None
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(
            f"{source} holds a {len(key)}-byte key; use at least {MIN_KEY_BYTES} bytes ({2 * MIN_KEY_BYTES} hex digits)"
        )
    return key


def read_authkey(environ: Mapping[str, str] | None = None) -> bytes | None:
    """The cluster's key from ``UNISON_AUTHKEY`` or ``UNISON_AUTHKEY_FILE``; None if neither is set.

    Raises:
        ValueError: if both are set, the key is not hex, is shorter than 16 bytes, or the
            file cannot be read.
    """
    environ = _environ(environ)
    text, path = environ.get(UNISON_AUTHKEY), environ.get(UNISON_AUTHKEY_FILE)
    if text is not None and path is not None:
        raise ValueError(f"both {UNISON_AUTHKEY} and {UNISON_AUTHKEY_FILE} are set; set only one")
    if text is not None:
        return _parse_key(text, UNISON_AUTHKEY)
    if path is not None:
        try:
            with open(path, encoding="ascii") as f:
                contents = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{UNISON_AUTHKEY_FILE}={path!r} cannot be read ({e}); fix the path") from e
        return _parse_key(contents, f"{UNISON_AUTHKEY_FILE} {path!r}")
    return None


def rendezvous_address(environ: Mapping[str, str] | None = None) -> str | None:
    """``UNISON_RENDEZVOUS``: the ``host:port`` of a store opened for the workers, or None."""
    return _environ(environ).get(UNISON_RENDEZVOUS) or None


def restart_count(environ: Mapping[str, str] | None = None) -> int:
    """``UNISON_RESTART_COUNT``: how often ``unison launch`` restarted the cluster (0 when unset).

    Raises:
        ValueError: if it is set to something other than a non-negative integer.
    """
    text = _environ(environ).get(UNISON_RESTART_COUNT, "").strip()
    if not text:
        return 0
    if not text.isdigit():
        raise ValueError(f"{UNISON_RESTART_COUNT}={text!r} is not a non-negative integer; unset it or fix it")
    return int(text)


def coordinator_port(environ: Mapping[str, str] | None = None) -> int | None:
    """``UNISON_COORDINATOR_PORT``, or None when unset.

    Raises:
        ValueError: if it is not a port in 1..65535.
    """
    text = _environ(environ).get(UNISON_COORDINATOR_PORT, "").strip()
    if not text:
        return None
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise ValueError(
            f"{UNISON_COORDINATOR_PORT}={text!r} is not a port in 1..65535; fix `{UNISON_COORDINATOR_PORT}`"
        )
    return int(text)


def thread_setting(environ: Mapping[str, str] | None = None) -> str | None:
    """``OMP_NUM_THREADS`` when the user (or a launcher) set it, else None.

    unison chooses a default intra-op thread count only when this is None.
    """
    text = _environ(environ).get("OMP_NUM_THREADS", "").strip()
    return text or None


def ps_shared_memory(environ: Mapping[str, str] | None = None) -> bool:
    """Whether a worker may exchange ps values through shared memory (``UNISON_PS_SHARED_MEMORY`` is not "0")."""
    return _environ(environ).get(UNISON_PS_SHARED_MEMORY, "1").strip() != "0"


def ps_sched_batch(environ: Mapping[str, str] | None = None) -> bool:
    """Whether a ps task's session threads run under ``SCHED_BATCH`` (``UNISON_PS_SCHED_BATCH`` is not "0")."""
    return _environ(environ).get(UNISON_PS_SCHED_BATCH, "1").strip() != "0"


def ps_in_workers(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the workers serve the ps tasks in their own processes (``UNISON_PS_IN_WORKERS``: "1"; "0" or unset: no).

    Raises:
        ValueError: for another value, naming it.
    """
    text = _environ(environ).get(UNISON_PS_IN_WORKERS, "0").strip()
    if text not in ("0", "1", ""):
        raise ValueError(f"{UNISON_PS_IN_WORKERS}={text!r} is neither '1' (the workers serve the ps tasks) nor "
                         f"'0'; fix: set it to 1 or 0, or unset it")
    return text == "1"


def terminal_streams(environ: Mapping[str, str] | None = None) -> frozenset[str] | None:
    """``UNISON_TERMINAL``: the launcher's streams that are terminals (``"stdout"``, ``"stderr"``).

    None when unset: the task was not started by ``unison launch``.
    """
    text = _environ(environ).get(UNISON_TERMINAL)
    if text is None:
        return None
    return frozenset(name.strip() for name in text.split(",") if name.strip())
