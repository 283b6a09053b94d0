"""The distribute coordinator: worker contexts, standard servers, and the control channel.

tf.distribute equivalent: ``distribute_coordinator`` and ``distribute_coordinator_context``.
"""

from unison.coordinator.channel import generate_authkey, read_authkey
from unison.coordinator.coordinator import CoordinatorMode, run_distribute_coordinator
from unison.coordinator.server import StandardServer, run_standard_server, stop_standard_servers
from unison.coordinator.worker_context import WorkerContext, get_current_worker_context

__all__ = [
    "CoordinatorMode",
    "run_distribute_coordinator",
    "get_current_worker_context",
    "WorkerContext",
    "StandardServer",
    "run_standard_server",
    "stop_standard_servers",
    "generate_authkey",
    "read_authkey",
]
