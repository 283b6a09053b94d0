"""How a run of a cluster ended, and how a task's exit status reads.

``LocalCluster.wait`` returns an :class:`Outcome`; the one-node and the multi-node
launchers both turn it into their messages and exit code, with ``exit_code`` (killed by
signal N reads as 128 + N, as in a shell) and ``signal_name``. Kept apart so that both
launchers word a failure alike.
"""

from __future__ import annotations

import dataclasses
import signal
from typing import TYPE_CHECKING

from unison._cluster import env

if TYPE_CHECKING:
    from unison._launch.procs import Task

__all__ = ["Outcome", "exit_code", "signal_name"]


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How one run of the cluster ended: ``failed`` is None on success."""

    failed: Task | None = None
    returncode: int = 0
    #: True when ``wait``'s ``stop_when`` asked to stop (e.g. a task on another node failed).
    stopped: bool = False
    #: The tasks that received a preemption signal, by name (``("worker:1",)``), as they
    #: recorded it (``env.UNISON_PREEMPTION_NOTICES``); the first task to exit with
    #: ``PREEMPTED_EXIT_CODE`` need not be one of them.
    notified: tuple[str, ...] = ()

    def describe_failure(self) -> str:
        """``"task worker:0 exited with code 1"``; for a preemption, the task(s) that got the notice."""
        if self.failed is None:
            return "no task failed"
        code = exit_code(self.returncode)
        notice = f" (notice to {', '.join(self.notified)})" if self.notified else ""
        if code == env.PREEMPTED_EXIT_CODE:
            text = (f"the job was preempted{notice} and saved at the agreed step; task {self.failed.name} "
                    f"exited first, with code {code}")
        else:
            text = f"task {self.failed.name} exited with code {code}"
            if self.returncode < 0:
                text += f" (killed by {signal_name(-self.returncode)})"
            if self.notified:
                text += f"; a preemption notice went to {', '.join(self.notified)}"
        return text


def exit_code(returncode: int) -> int:
    """A task's status as a shell exit code: killed by signal N -> 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def signal_name(signum: int) -> str:
    """``"SIGTERM"`` for 15; ``"signal N"`` for a number that names no signal."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
