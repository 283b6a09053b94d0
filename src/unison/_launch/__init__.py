"""``unison launch``: run a script as every task of a local cluster; ``unison server``.

See ``unison._launch.cli`` for the command line and ``unison._launch.procs`` for the
process management it rests on.
"""

from unison._launch.cli import launch_main, main
from unison._launch.local_run import run_local_cluster
from unison._launch.procs import LocalCluster, Task, plan_tasks

__all__ = ["main", "launch_main", "run_local_cluster", "LocalCluster", "Task", "plan_tasks"]
