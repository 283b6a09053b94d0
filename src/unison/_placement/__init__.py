"""Ensemble placement (AdaNet): which worker builds and trains which part of an ensemble.

``ReplicationStrategy`` has every worker build and train everything;
``RoundRobinStrategy`` dedicates workers to the ensemble and deals the subnetworks to
the others, and can put each subnetwork's parameters on parameter servers of its own.
Give a strategy its cluster with ``PlacementConfig.from_strategy(strategy)``::

    placement = unison.placement.RoundRobinStrategy()
    placement.config = unison.placement.PlacementConfig.from_strategy(strategy)
    for i in range(k):
        if placement.should_build_subnetwork(k, i):
            with strategy.scope(), placement.subnetwork_devices(k, i):
                subnetworks[i] = build_subnetwork(i)

The name hash and the hook that put a subnetwork's parameters on its ps tasks are the
parameter servers' own (``unison._ps.remote_variables.name_placement``), re-exported here.

AdaNet equivalent: ``adanet.distributed.placement``.
"""

from unison._placement.config import PlacementConfig
from unison._placement.parameter_servers import array_split, subnetwork_ps_group
from unison._placement.strategies import PlacementStrategy, ReplicationStrategy, RoundRobinStrategy
from unison._ps.remote_variables.name_placement import OpNameHashStrategy, ParameterPlacementHook, PsGroupAssigner

__all__ = [
    "PlacementStrategy",
    "ReplicationStrategy",
    "RoundRobinStrategy",
    "PlacementConfig",
    "OpNameHashStrategy",
    "ParameterPlacementHook",
    "PsGroupAssigner",
    "array_split",
    "subnetwork_ps_group",
]
