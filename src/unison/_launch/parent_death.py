"""Tasks that die with their launcher: the kernel's parent-death signal, set before ``exec``.

``unison launch`` starts each task in a session of its own, so no terminal hang-up or
group signal reaches a task when the launcher is killed with SIGKILL; without this a
task would train on as an orphan. Kept apart from the launcher's process management
(``procs.py``) because what is here runs in the task's own process, before its program:
a few lines of plain Python, run with ``python -S``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

__all__ = ["die_with_launcher"]

# Runs before the task's program, in the task's process (then replaced by it through
# exec): asks the kernel for SIGKILL when the launcher dies (PR_SET_PDEATHSIG = 1; it
# survives execve), then checks that the launcher did not die before that was in place.
_DIE_WITH_PARENT = """
import ctypes, os, signal, sys
if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0) != 0:
    print(f"unison launch: this task will not die with the launcher: prctl(PR_SET_PDEATHSIG) failed "
          f"({os.strerror(ctypes.get_errno())})", file=sys.stderr)
elif os.getppid() != int(sys.argv[1]):
    os.kill(os.getpid(), signal.SIGKILL)
os.execvp(sys.argv[2], sys.argv[2:])
"""


def die_with_launcher(command: Sequence[str]) -> list[str]:
    """``command``, made to receive SIGKILL when the launcher process dies (Linux).

    Tasks run in sessions of their own (so a task's process group holds it and what it
    starts), hence no terminal hang-up or group signal reaches them when the launcher
    is killed with SIGKILL; without this they would keep training unseen. The kernel's
    parent-death signal (``prctl(PR_SET_PDEATHSIG)``) is set by a short Python step that
    then ``exec``s the command in the same process, rather than in a ``preexec_fn``,
    which Python documents as unsafe while other threads run (the launcher's output
    pumps do). SIGKILL, not SIGTERM: a launcher that died abruptly cannot follow up a
    SIGTERM that the task ignores. Processes that the task starts are not covered (torch
    DataLoader workers watch their own parent).

    The signal fires when the *thread* that started the task ends, so the thread that
    calls ``LocalCluster.start`` must outlive the tasks (``run_local_cluster`` does).
    Elsewhere than on Linux the command is returned unchanged.

    Args:
        command: the task's program and arguments.

    Returns:
        The command to start instead.
    """
    if not sys.platform.startswith("linux"):
        return list(command)
    return [sys.executable, "-S", "-c", _DIE_WITH_PARENT, str(os.getpid()), *command]
