"""The scheduler contract: what a scheduler's conventions add to a resolved cluster.

A resolver says where the tasks are; the scheduler that started them decides a few
things more: which variable holds a process's index on its host, what names the run in
the rendezvous store's keys, whether the workers meet at a store of the scheduler's own,
how many CPUs a task may take, and how a cluster that lost a task is restarted. Each
scheduler's answers live in one final class beside its resolver (``TorchrunScheduler`` in
``torchrun.py``, ``SlurmScheduler`` in ``slurm.py``); :class:`LaunchScheduler` answers for
``unison launch`` and every environment without conventions of its own (``TF_CONFIG``,
SageMaker, Kubernetes, an explicit cluster). A resolver names its scheduler
(``ClusterResolver.scheduler``) and the resolved cluster carries it, so no code outside
the resolvers asks which scheduler runs it by name (JAX's ``clusters/`` keep each
environment's knowledge in its class the same way).
"""

from __future__ import annotations

import abc
import enum
import typing
from collections.abc import Mapping

__all__ = ["Scheduler", "LaunchScheduler", "RendezvousKind", "LAUNCH"]


class RendezvousKind(str, enum.Enum):
    """How the workers of a resolved cluster meet to form their process group."""

    #: No group: local training, or a task that does not train (ps, evaluator, client).
    NONE = "none"
    #: The collective leader hosts a TCPStore at its cluster address; the others connect.
    LEADER = "leader"
    #: Every worker connects to a store someone else already opened (``UNISON_RENDEZVOUS``,
    #: or the store the distribute coordinator's standalone client opened).
    STORE = "store"
    #: torchrun's own store, through ``init_method="env://"``.
    TORCHRUN = "torchrun"


class Scheduler(abc.ABC):
    """Abstract conventions of the scheduler that started this process.

    Subclasses are final and hold no state, so two instances of one class are equal and
    a resolved cluster that carries one pickles and compares as a value.
    """

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self)

    def __hash__(self) -> int:
        return hash(type(self))

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """The environment's name, as the resolver's ``environment`` gives it ("" for unison's own)."""

    @abc.abstractmethod
    def local_rank(self, environ: Mapping[str, str]) -> int | None:
        """This process's index on its host, where the scheduler sets one; else None."""

    @abc.abstractmethod
    def rendezvous_token(self, environ: Mapping[str, str]) -> str:
        """A name for this run that goes into the rendezvous store's keys ("" when there is none).

        A task that reaches another run's store (a port clash on a shared node) then finds
        keys of another run and says so, instead of joining it.
        """

    @abc.abstractmethod
    def rendezvous_kind(self) -> RendezvousKind:
        """Where the training tasks meet when nobody opened a store for them: the
        collective leader's address (``LEADER``) or the scheduler's own store."""

    @abc.abstractmethod
    def cpu_share(self, environ: Mapping[str, str], tasks_on_host: int) -> int | None:
        """CPUs one task may use, where the scheduler divides a host between tasks without
        setting threads; None where a launcher sets the threads itself."""

    @abc.abstractmethod
    def restart_advice(self) -> str:
        """How to restart a cluster that lost a task, in the words of this scheduler (one or
        more sentences, for the message of a ``PeerLostError``)."""


@typing.final
class LaunchScheduler(Scheduler):
    """``unison launch``'s conventions, also those of ``TF_CONFIG`` clusters, SageMaker,
    Kubernetes and explicit clusters: the leader hosts the store, the launcher sets
    ``OMP_NUM_THREADS``, and ``unison launch --max-restarts`` restarts the cluster."""

    @property
    def name(self) -> str:
        return ""

    def local_rank(self, environ: Mapping[str, str]) -> int | None:
        return None

    def rendezvous_token(self, environ: Mapping[str, str]) -> str:
        return ""

    def rendezvous_kind(self) -> RendezvousKind:
        return RendezvousKind.LEADER

    def cpu_share(self, environ: Mapping[str, str], tasks_on_host: int) -> int | None:
        return None

    def restart_advice(self) -> str:
        return "Restart the cluster (e.g. `unison launch --max-restarts N`) and resume from the last checkpoint."


#: The one instance of :class:`LaunchScheduler`.
LAUNCH = LaunchScheduler()
