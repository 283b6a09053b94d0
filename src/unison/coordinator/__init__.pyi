"""Types of ``unison.coordinator``'s names, for type checkers; ``__init__.py`` loads each on first use."""

from unison._coordinator.channel import generate_authkey, read_authkey
from unison._coordinator.distribute_coordinator import CoordinatorMode, run_distribute_coordinator
from unison._coordinator.standard_server import StandardServer, run_standard_server, stop_standard_servers
from unison._coordinator.worker_context import WorkerContext, get_current_worker_context

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
