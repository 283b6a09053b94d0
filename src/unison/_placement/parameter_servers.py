"""The ps tasks dedicated to each subnetwork: AdaNet's rule for ``RoundRobinStrategy``.

With ``RoundRobinStrategy(dedicate_parameter_servers=True)`` each subnetwork's
parameters live on a group of ps tasks of its own, so a worker that trains one
subnetwork talks to that group only (AdaNet: O(m*n/k) variable fetches for m workers, n
ps and k subnetworks, against O(m*n*k) when every worker reads everything). The ps tasks
are split into ``num_subnetworks`` contiguous groups; with more subnetworks than ps
tasks, subnetworks share the one-task groups modulo the ps count.

Inside a group a parameter goes to the task its name hashes to, and the strategy's
variable policy places it there: both are the parameter servers' own
(:mod:`unison._ps.remote_variables.name_placement`: ``PsGroupAssigner``, ``OpNameHashStrategy``,
``ParameterPlacementHook``), re-exported from ``unison.placement``. The group rule stays
here, above ``unison._ps``, because it is a rule on subnetworks and checks them with
:mod:`unison._placement.round_robin`.

AdaNet equivalent: ``RoundRobinStrategy.subnetwork_devices``' choice of ps tasks.
"""

from __future__ import annotations

from unison._placement.round_robin import check_num_subnetworks, check_subnetwork_index

__all__ = ["array_split", "subnetwork_ps_group"]


def array_split(length: int, sections: int) -> list[range]:
    """Splits ``range(length)`` into ``sections`` contiguous ranges, as ``numpy.array_split``.

    The first ``length % sections`` ranges are one longer than the rest; with more
    sections than elements the trailing ranges are empty.

    Example:
        >>> array_split(5, 3)
        [range(0, 2), range(2, 4), range(4, 5)]
    """
    size, longer = divmod(length, sections)
    parts, start = [], 0
    for section in range(sections):
        stop = start + size + (1 if section < longer else 0)
        parts.append(range(start, stop))
        start = stop
    return parts


def subnetwork_ps_group(num_ps_replicas: int, num_subnetworks: int, subnetwork_index: int) -> range:
    """The ps tasks dedicated to subnetwork ``subnetwork_index`` of ``num_subnetworks``.

    ``array_split(range(num_ps_replicas), num_subnetworks)[g]`` with ``g =
    subnetwork_index % num_ps_replicas`` when there are more subnetworks than ps tasks
    (then each group is one task, shared modulo the ps count), else ``g =
    subnetwork_index`` (disjoint groups covering every ps task).

    Raises:
        ValueError: if ``num_ps_replicas < 1``, ``num_subnetworks < 1`` or the index is out
            of range.

    Example:
        >>> [subnetwork_ps_group(4, 2, index) for index in range(2)]
        [range(0, 2), range(2, 4)]
        >>> [subnetwork_ps_group(2, 3, index) for index in range(3)]
        [range(0, 1), range(1, 2), range(0, 1)]
    """
    if not isinstance(num_ps_replicas, int) or isinstance(num_ps_replicas, bool) or num_ps_replicas < 1:
        raise ValueError(
            f"subnetwork_ps_group needs num_ps_replicas >= 1, got {num_ps_replicas!r}: without parameter "
            f"servers there is nothing to dedicate; fix `num_ps_replicas`"
        )
    check_num_subnetworks(num_subnetworks)
    check_subnetwork_index(num_subnetworks, subnetwork_index)
    group = subnetwork_index % num_ps_replicas if num_subnetworks > num_ps_replicas else subnetwork_index
    return array_split(num_ps_replicas, num_subnetworks)[group]
