"""Placement of named parameters onto ps tasks: the name hash, the group assigner, and the hook.

A strategy whose variable policy implements :class:`ParameterPlacementHook` (the
parameter-server strategy's, :class:`unison._ps.remote_variables.variable_policy.PSVariablePolicy`) places the
parameters created inside ``place_parameters_in(assign)`` on ps task ``assign(name)``.
:class:`PsGroupAssigner` is such an ``assign``: it spreads names over a contiguous group
of ps tasks by a stable hash (:class:`OpNameHashStrategy`). Which group a subnetwork
gets is the ensemble placement's rule (``unison.placement.subnetwork_ps_group``), which
builds on these; the names are re-exported from ``unison.placement``.

AdaNet equivalent: ``adanet.distributed.devices._OpNameHashStrategy`` and the device
function ``RoundRobinStrategy.subnetwork_devices`` installs; the TF device function
becomes the hook.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import typing
from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["OpNameHashStrategy", "PsGroupAssigner", "ParameterPlacementHook"]


@typing.final
class OpNameHashStrategy:
    """Picks one of ``num_tasks`` tasks for a name: ``sha256(name) mod num_tasks``.

    A stable hash (not Python's salted ``hash``) so every process, in every run, puts
    the same parameter on the same task.

    AdaNet equivalent: ``adanet.distributed.devices._OpNameHashStrategy`` (which hashes
    a TF op's name; here the name is given directly).

    Args:
        num_tasks: how many tasks to choose among (>= 1).

    Raises:
        ValueError: if ``num_tasks`` is not an integer >= 1.

    Example:
        >>> [OpNameHashStrategy(3)(name) for name in ("foo", "bar", "baz")]
        [2, 0, 1]
    """

    def __init__(self, num_tasks: int):
        if not isinstance(num_tasks, int) or isinstance(num_tasks, bool) or num_tasks < 1:
            raise ValueError(f"OpNameHashStrategy needs num_tasks >= 1, got {num_tasks!r}; fix `num_tasks`")
        self._num_tasks = num_tasks

    @property
    def num_tasks(self) -> int:
        """How many tasks names are spread over."""
        return self._num_tasks

    def __call__(self, name: str) -> int:
        """The task (``0..num_tasks - 1``) for ``name``.

        Raises:
            TypeError: if ``name`` is not a str.
        """
        if not isinstance(name, str):
            raise TypeError(f"OpNameHashStrategy hashes names (str), got {type(name).__name__} {name!r}")
        return int(hashlib.sha256(name.encode()).hexdigest(), 16) % self._num_tasks

    def __repr__(self) -> str:
        return f"OpNameHashStrategy({self._num_tasks})"


@dataclasses.dataclass(frozen=True)
class PsGroupAssigner:
    """``assign(name)`` for a group of ps tasks: ``ps_group[0] + OpNameHashStrategy(len(ps_group))(name)``.

    The ``assign`` function ``RoundRobinStrategy.subnetwork_devices`` hands to
    :meth:`ParameterPlacementHook.place_parameters_in`. Picklable (a frozen dataclass
    of a range), so a strategy may send it to another process.

    Args:
        ps_group: the ps tasks to spread over, a non-empty contiguous range.

    Raises:
        ValueError: if ``ps_group`` is not a non-empty range with step 1.

    Example:
        >>> [PsGroupAssigner(range(3, 6))(name) for name in ("foo", "bar", "baz")]
        [5, 3, 4]
    """

    ps_group: range

    def __post_init__(self) -> None:
        group = self.ps_group
        if not isinstance(group, range) or len(group) == 0 or group.step != 1 or group.start < 0:
            raise ValueError(
                f"PsGroupAssigner needs a non-empty range of ps task indices with step 1, got {group!r}; "
                f"fix `ps_group`, e.g. subnetwork_ps_group(num_ps, num_subnetworks, index)"
            )

    def __call__(self, name: str) -> int:
        """The ps task (an index into the cluster's ps job) for the parameter called ``name``."""
        return self.ps_group.start + OpNameHashStrategy(len(self.ps_group))(name)


@typing.runtime_checkable
class ParameterPlacementHook(Protocol):
    """What a strategy's variable policy (``strategy.extended.components.variable_policy``)
    offers for ``subnetwork_devices`` to place parameters.

    ``place_parameters_in(assign)`` returns a context manager. Each parameter created
    inside it on a module created inside it is placed on parameter-server task
    ``assign(name)`` (an index into the cluster's ``ps`` job, ``0..num_ps - 1``), where
    ``name`` is the parameter's name in ``named_parameters()`` of its outermost module
    created inside the context (one that is not a submodule of another module created
    inside), e.g. ``"0.weight"`` for ``Sequential(Linear(...))``. So the strategy may
    decide the placement when the context exits, once the module tree is complete.
    Modules created outside the context, and variables that belong to no module created
    inside it, keep the strategy's default placement. ``assign`` is a pure, picklable
    function of the name. When the context exits with an exception, the strategy need
    place nothing; the exception propagates.

    A strategy whose policy has no such hook (every strategy but the parameter-server one) keeps
    its default placement: ``subnetwork_devices`` is then a no-op.

    AdaNet equivalent: the device function that ``subnetwork_devices`` installs with
    ``tf.device`` (``"/job:ps/task:{assign(op)}"`` for variable ops).
    """

    def place_parameters_in(self, assign: Callable[[str], int]) -> contextlib.AbstractContextManager[Any]:
        """A context in which created parameters are placed on ps task ``assign(name)``."""
        ...
