"""One run of a local cluster: start, wait, and stop on a signal (shared by every restart loop)."""

from __future__ import annotations

import signal

from unison._launch.interrupts import Interrupted
from unison._launch.outcome import Outcome, signal_name
from unison._launch.procs import LocalCluster

__all__ = ["run_once"]


def run_once(cluster: LocalCluster) -> Outcome | int:
    """Starts ``cluster`` and waits for its outcome; interrupted (Ctrl-C, SIGTERM), stops every
    task and returns the exit status ``128 + signal``. A failed start stops what started."""
    try:
        try:
            cluster.start()
        except BaseException:
            cluster.stop()
            raise
        return cluster.wait()
    except (KeyboardInterrupt, Interrupted) as e:
        signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
        cluster.stop()
        cluster.message(f"interrupted by {signal_name(signum)}; stopped every task")
        return 128 + signum
