"""``unison launch``: run a script as every task of a local cluster; ``unison server``.

See ``unison.launch.cli`` for the command line and ``unison.launch.procs`` for the
process management it rests on.
"""

from unison.launch.cli import launch_main, main
from unison.launch.local_run import run_local_cluster
from unison.launch.procs import LocalCluster, Task, plan_tasks

__all__ = ["main", "launch_main", "run_local_cluster", "LocalCluster", "Task", "plan_tasks"]
