"""Types of ``unison.coordinator``'s names, for type checkers; ``__init__.py`` loads each on first use."""


from .channel import generate_authkey, read_authkey
from .distribute_coordinator import CoordinatorMode, run_distribute_coordinator
from .standard_server import StandardServer, run_standard_server, stop_standard_servers
from .worker_context import WorkerContext, get_current_worker_context

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
