"""Names of the environment variables that describe a cluster to unison.

Every variable unison reads or writes to form a cluster is named here once, so the
launcher that sets them and the resolvers and coordinator that read them cannot drift
apart. Scheduler-owned variables (torchrun's ``RANK``/``WORLD_SIZE``/..., SLURM's
``SLURM_*``) are read only by their own resolver and are named in that module.
"""

from __future__ import annotations

__all__ = [
    "TF_CONFIG",
    "UNISON_AUTHKEY",
    "UNISON_AUTHKEY_FILE",
    "UNISON_COORDINATOR_PORT",
    "UNISON_RESTART_COUNT",
    "UNISON_RENDEZVOUS",
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
