"""Ensemble placement strategies: which worker builds and trains which part of an ensemble.

An AdaNet-style ensemble has ``k`` subnetworks and an ensemble over them (e.g. learned
mixture weights). A placement strategy tells each worker, from the cluster in its
``config``, whether to build the ensemble, which subnetworks to build, whether to train
them, and where their parameters live (``subnetwork_devices``).

AdaNet equivalent: ``adanet.distributed.placement`` (``PlacementStrategy``,
``ReplicationStrategy``, ``RoundRobinStrategy``). Differences: the config is a
:class:`PlacementConfig` (AdaNet: a ``RunConfig``), a strategy used before its config is
set raises :class:`unison.errors.PlacementError`, arguments are validated, and the
``drop_remainder`` warning counts the dropped subnetworks right.
"""

from __future__ import annotations

import abc
import contextlib
import typing
import warnings
from collections.abc import Iterator

from unison._placement import round_robin
from unison._placement.config import PlacementConfig
from unison._placement.parameter_servers import subnetwork_ps_group
from unison._ps.remote_variables.name_placement import ParameterPlacementHook, PsGroupAssigner
from unison._strategies import current as _current
from unison.errors import PlacementError

__all__ = ["PlacementStrategy", "ReplicationStrategy", "RoundRobinStrategy"]

_NO_INDEX: typing.Any = object()  # "no subnetwork_index given" (None is a bad index to report)


class PlacementStrategy(abc.ABC):
    """Decides which parts of an ensemble the current worker builds and trains.

    Set :attr:`config` from the cluster first (``PlacementConfig.from_strategy(strategy)``),
    then ask, for each iteration's ``num_subnetworks``: :meth:`should_build_ensemble`,
    :meth:`should_build_subnetwork`, :meth:`should_train_subnetworks`, and build each
    subnetwork inside :meth:`subnetwork_devices`. Subclasses are final.

    AdaNet equivalent: ``adanet.distributed.PlacementStrategy``.
    """

    _config: PlacementConfig | None = None

    @property
    def config(self) -> PlacementConfig:
        """The cluster this strategy places for.

        Raises:
            PlacementError: if it was not set yet.
        """
        if self._config is None:
            raise PlacementError(
                f"{type(self).__name__} has no config: it cannot tell what this worker builds before it knows "
                f"the cluster; set `placement.config = unison.placement.PlacementConfig.from_strategy(strategy)` "
                f"(or PlacementConfig(num_worker_replicas, global_id_in_cluster, num_ps_replicas)) first"
            )
        return self._config

    @config.setter
    def config(self, config: PlacementConfig) -> None:
        if not isinstance(config, PlacementConfig):
            raise TypeError(
                f"{type(self).__name__}.config must be a unison.placement.PlacementConfig, got "
                f"{type(config).__name__}; build one with PlacementConfig.from_strategy(strategy)"
            )
        self._config = config

    def _configured(self, num_subnetworks: int, subnetwork_index: int = _NO_INDEX) -> PlacementConfig:
        """Checks the arguments and returns the config (so a bad call fails the same way everywhere)."""
        round_robin.check_num_subnetworks(num_subnetworks)
        if subnetwork_index is not _NO_INDEX:
            round_robin.check_subnetwork_index(num_subnetworks, subnetwork_index)
        return self.config

    @abc.abstractmethod
    def should_build_ensemble(self, num_subnetworks: int) -> bool:
        """Whether this worker builds the ensemble of this iteration's ``num_subnetworks`` subnetworks.

        Raises:
            ValueError: if ``num_subnetworks`` is not an integer >= 1.
            PlacementError: if :attr:`config` is not set.
        """

    @abc.abstractmethod
    def should_build_subnetwork(self, num_subnetworks: int, subnetwork_index: int) -> bool:
        """Whether this worker builds subnetwork ``subnetwork_index`` (``0..num_subnetworks - 1``).

        Raises:
            ValueError: for ``num_subnetworks < 1`` or an index out of range.
            PlacementError: if :attr:`config` is not set.
        """

    @abc.abstractmethod
    def should_train_subnetworks(self, num_subnetworks: int) -> bool:
        """Whether this worker trains the subnetworks it builds.

        Raises:
            ValueError: if ``num_subnetworks`` is not an integer >= 1.
            PlacementError: if :attr:`config` is not set.
        """

    @abc.abstractmethod
    def subnetwork_devices(
        self, num_subnetworks: int, subnetwork_index: int
    ) -> contextlib.AbstractContextManager[None]:
        """A context in which to build subnetwork ``subnetwork_index``'s modules.

        Raises (on entering):
            ValueError: for ``num_subnetworks < 1`` or an index out of range.
            PlacementError: if :attr:`config` is not set.
        """


@typing.final
class ReplicationStrategy(PlacementStrategy):
    """Every worker builds and trains the whole ensemble, with default parameter placement.

    Simple, but for m workers, n parameter servers and k subnetworks it costs
    O(m*n*k) parameter fetches and O(k) memory per worker, and each subnetwork sees
    O(m) stale gradients under asynchronous training.

    AdaNet equivalent: ``adanet.distributed.ReplicationStrategy``.

    Example:
        >>> placement = ReplicationStrategy()
        >>> placement.config = PlacementConfig(num_worker_replicas=4, global_id_in_cluster=3)
        >>> placement.should_build_ensemble(3), placement.should_train_subnetworks(3)
        (True, True)
    """

    def should_build_ensemble(self, num_subnetworks: int) -> bool:
        """True: every worker builds the ensemble."""
        self._configured(num_subnetworks)
        return True

    def should_build_subnetwork(self, num_subnetworks: int, subnetwork_index: int) -> bool:
        """True: every worker builds every subnetwork."""
        self._configured(num_subnetworks, subnetwork_index)
        return True

    def should_train_subnetworks(self, num_subnetworks: int) -> bool:
        """True: every worker trains every subnetwork."""
        self._configured(num_subnetworks)
        return True

    @contextlib.contextmanager
    def subnetwork_devices(self, num_subnetworks: int, subnetwork_index: int) -> Iterator[None]:
        """A no-op: parameters go where the current strategy puts them by default."""
        self._configured(num_subnetworks, subnetwork_index)
        yield

    def __repr__(self) -> str:
        return "ReplicationStrategy()"


@typing.final
class RoundRobinStrategy(PlacementStrategy):
    """Dedicated ensemble workers, and subnetworks dealt round-robin to the other workers.

    Workers are dealt tasks in rounds of ``num_subnetworks + 1``: the first worker of a
    round builds the ensemble (it builds every subnetwork, frozen, and trains only the
    ensemble's own variables); each other worker builds and trains one subnetwork. With
    more workers than a round, later rounds repeat the assignment; a trailing partial
    round deals all subnetworks over its few workers (``drop_remainder=False``) or only
    the first ones (``drop_remainder=True``). With one subnetwork or one worker, every
    worker builds and trains everything. The rules are in
    :mod:`unison._placement.round_robin`.

    For m workers, n parameter servers and k subnetworks this scales as O(m/k) training
    speed-up, O(m*n/k) parameter fetches, O(1) memory per worker, and O(m/k) stale
    gradients per subnetwork under asynchronous training.

    AdaNet equivalent: ``adanet.distributed.RoundRobinStrategy``. Difference: the
    ``drop_remainder`` warning is a ``UserWarning`` naming the right number of dropped
    subnetworks (``n - workers + 1``), also when there are as many subnetworks as workers.

    Args:
        drop_remainder: with ``True`` each subnetwork worker trains exactly one
            subnetwork, and subnetworks no worker gets (fewer than ``n + 1`` workers) are
            not trained (a ``UserWarning`` says which); with ``False`` a worker of the
            trailing partial round trains several subnetworks so that none is left out.
        dedicate_parameter_servers: place each subnetwork's parameters on a ps group of its
            own (see :meth:`subnetwork_devices`); with ``False`` default placement.

    Example:
        >>> placement = RoundRobinStrategy()
        >>> placement.config = PlacementConfig(num_worker_replicas=7, global_id_in_cluster=5)
        >>> [placement.should_build_subnetwork(3, i) for i in range(3)]  # 2 slots in the last round
        [True, False, True]
    """

    def __init__(self, drop_remainder: bool = False, dedicate_parameter_servers: bool = True):
        for name, value in (("drop_remainder", drop_remainder),
                            ("dedicate_parameter_servers", dedicate_parameter_servers)):
            if not isinstance(value, bool):
                raise TypeError(f"RoundRobinStrategy({name}=...) must be a bool, got {value!r}; fix `{name}`")
        self._drop_remainder = drop_remainder
        self._dedicate_parameter_servers = dedicate_parameter_servers

    @property
    def drop_remainder(self) -> bool:
        """Whether subnetworks left without a worker of their own are dropped."""
        return self._drop_remainder

    @property
    def dedicate_parameter_servers(self) -> bool:
        """Whether each subnetwork's parameters live on a ps group of its own."""
        return self._dedicate_parameter_servers

    def _assigned(self, num_subnetworks: int, subnetwork_index: int = _NO_INDEX) -> PlacementConfig:
        """``_configured``, plus the warning when this cluster drops subnetworks."""
        config = self._configured(num_subnetworks, subnetwork_index)
        dropped = round_robin.dropped_subnetworks(config.num_worker_replicas, num_subnetworks, self._drop_remainder)
        if dropped:
            # stacklevel 3: the frame that called the public should_* method, not this helper.
            warnings.warn(
                f"RoundRobinStrategy(drop_remainder=True) with {config.num_worker_replicas} workers and "
                f"{num_subnetworks} subnetworks drops {len(dropped)} subnetwork(s), indices "
                f"{dropped.start}..{dropped.stop - 1}: no worker trains them; use drop_remainder=False to "
                f"train them on workers that already have a subnetwork, or run at least "
                f"{num_subnetworks + 1} workers",
                UserWarning,
                stacklevel=3,
            )
        return config

    def should_build_ensemble(self, num_subnetworks: int) -> bool:
        """Whether this worker is an ensemble worker (task 0 of its round), or there is one subnetwork."""
        config = self._assigned(num_subnetworks)
        return round_robin.builds_ensemble(config.num_worker_replicas, config.worker_index, num_subnetworks)

    def should_build_subnetwork(self, num_subnetworks: int, subnetwork_index: int) -> bool:
        """Whether this worker builds the subnetwork: it is an ensemble worker or the subnetwork is its own."""
        config = self._assigned(num_subnetworks, subnetwork_index)
        return round_robin.builds_subnetwork(config.num_worker_replicas, config.worker_index, num_subnetworks,
                                             subnetwork_index, self._drop_remainder)

    def should_train_subnetworks(self, num_subnetworks: int) -> bool:
        """Whether this worker trains subnetworks: all but ensemble workers (all, with one worker or subnetwork)."""
        config = self._assigned(num_subnetworks)
        return round_robin.trains_subnetworks(config.num_worker_replicas, config.worker_index, num_subnetworks)

    @contextlib.contextmanager
    def subnetwork_devices(self, num_subnetworks: int, subnetwork_index: int) -> Iterator[None]:
        """Places the subnetwork's parameters created inside on its dedicated ps group.

        The group is ``subnetwork_ps_group(num_ps_replicas, num_subnetworks,
        subnetwork_index)``; in it a parameter goes to ps task ``group[0] +
        OpNameHashStrategy(len(group))(name)`` (:class:`PsGroupAssigner`), through the
        current strategy's variable policy (a :class:`ParameterPlacementHook`).

        A no-op — default placement — with ``dedicate_parameter_servers=False``, a
        cluster without ps tasks, or when the current strategy (``unison.get_strategy()``)
        has no placement hook: every strategy but the parameter-server one, and no strategy.
        So enter it inside the strategy's scope: ``with strategy.scope(),
        placement.subnetwork_devices(k, i):``.
        """
        config = self._configured(num_subnetworks, subnetwork_index)
        policy = _current.get_strategy().extended.components.variable_policy
        if (not self._dedicate_parameter_servers or config.num_ps_replicas == 0
                or not isinstance(policy, ParameterPlacementHook)):
            yield
            return
        assign = PsGroupAssigner(subnetwork_ps_group(config.num_ps_replicas, num_subnetworks, subnetwork_index))
        with policy.place_parameters_in(assign):
            yield

    def __repr__(self) -> str:
        return (f"RoundRobinStrategy(drop_remainder={self._drop_remainder}, "
                f"dedicate_parameter_servers={self._dedicate_parameter_servers})")
