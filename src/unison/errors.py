"""Runtime errors raised by unison.

Bad arguments raise the builtin ``ValueError`` / ``TypeError`` at the API boundary.
Failures at run time raise a :class:`UnisonError` subclass that also inherits the
matching builtin, so existing ``except TimeoutError:`` or ``except RuntimeError:``
clauses keep working.
"""

from __future__ import annotations

__all__ = [
    "UnisonError",
    "MergeCallError",
    "CollectiveTimeoutError",
    "PeerLostError",
    "CollectiveMismatchError",
    "ClusterError",
    "AuthenticationError",
    "GradientSyncError",
    "UsageError",
    "CheckpointError",
    "PlacementError",
    "ParameterServerError",
    "FunctionCancelledError",
]


class UnisonError(Exception):
    """Base class of every runtime error unison raises."""


class MergeCallError(UnisonError, RuntimeError):
    """Replicas disagreed on ``merge_call``: some called it while others returned."""


class CollectiveTimeoutError(UnisonError, TimeoutError):
    """A collective did not complete within ``CommunicationOptions.timeout_seconds``."""


class PeerLostError(CollectiveTimeoutError):
    """A peer task left the process group (crashed, killed or disconnected)."""


class CollectiveMismatchError(UnisonError, ValueError):
    """Workers passed tensors of different shapes or dtypes to the same collective."""


class ClusterError(UnisonError, RuntimeError):
    """The cluster could not be formed or a task of it failed."""


class AuthenticationError(UnisonError, PermissionError):
    """A peer on the coordinator's control channel did not prove the cluster's key."""


class GradientSyncError(UnisonError, RuntimeError):
    """A training step used gradient synchronisation wrongly (``opt.step()`` outside
    ``strategy.run`` with several replicas, inside ``no_sync()``, or a gradient computed twice)."""


class PlacementError(UnisonError, RuntimeError):
    """An ensemble placement strategy was asked where to build before it knew its cluster.

    Set ``placement_strategy.config`` (e.g. ``PlacementConfig.from_strategy(strategy)``)
    before calling its ``should_*`` methods or ``subnetwork_devices``.
    """


class UsageError(UnisonError, RuntimeError):
    """An API was called in a state where it cannot work (e.g. ``unpack`` before ``pack``,
    ``experimental_set_strategy`` inside a scope); the message names the call that must come first."""


class ParameterServerError(ClusterError):
    """A parameter-server task (``ps:K``) died, disconnected or did not answer in time.

    Training cannot go on without the variables it held: restart the cluster and
    restore the last checkpoint (tf.distribute raises ``UnavailableError`` here).
    Also raised when a ps task refuses this task's key (``AuthenticationError`` as its
    cause): then the ps task serves on, and the message says how to fix the key.
    """


class FunctionCancelledError(UnisonError, RuntimeError):
    """A function scheduled on a ClusterCoordinator was cancelled because an earlier one failed.

    Like ``tf.errors.CancelledError`` from ``RemoteValue.fetch()``: reschedule it.
    """


class CheckpointError(UnisonError, OSError):
    """A checkpoint could not be written (a full disk) or restored (a backup that does not fit)."""
