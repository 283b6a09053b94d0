"""The schedulers unison knows by name, for resolvers that only carry a name.

``SimpleClusterResolver(environment=...)`` and ``TF_CONFIG``'s ``environment`` name the
environment with a string (as in TensorFlow). A name of a scheduler with conventions of
its own ("torchrun", "slurm") brings them; any other name (TF's "cloud", "google", "")
follows unison launch's (:data:`~unison._cluster.scheduler.LAUNCH`). Resolvers that
read a scheduler's own variables name their scheduler themselves.
"""

from __future__ import annotations

from unison._cluster.scheduler import LAUNCH, Scheduler
from unison._cluster.slurm import SLURM
from unison._cluster.torchrun import TORCHRUN

__all__ = ["SCHEDULERS", "scheduler_named"]

#: The schedulers with conventions of their own, each found by its ``name``.
SCHEDULERS: tuple[Scheduler, ...] = (TORCHRUN, SLURM)


def scheduler_named(name: str | None) -> Scheduler:
    """The scheduler whose ``name`` is ``name``; ``LAUNCH`` for any other name or None.

    Example:
        >>> scheduler_named("slurm"), scheduler_named("cloud")
        (SlurmScheduler(), LaunchScheduler())
    """
    return next((scheduler for scheduler in SCHEDULERS if scheduler.name == name), LAUNCH)
