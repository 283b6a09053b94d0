"""Ensemble placement (AdaNet): which worker builds and trains which part of an ensemble.

``ReplicationStrategy`` has every worker build and train everything;
``RoundRobinStrategy`` dedicates workers to the ensemble and deals the subnetworks to
the others, and can put each subnetwork's parameters on parameter servers of its own
(``subnetwork_ps_group`` names them; inside a group, ``OpNameHashStrategy`` picks the task
a parameter's name hashes to). Give a strategy its cluster with
``PlacementConfig.from_strategy(strategy)``::

    placement = unison.placement.RoundRobinStrategy()
    placement.config = unison.placement.PlacementConfig.from_strategy(strategy)
    for i in range(k):
        if placement.should_build_subnetwork(k, i):
            with strategy.scope(), placement.subnetwork_devices(k, i):
                subnetworks[i] = build_subnetwork(i)

AdaNet equivalent: ``adanet.distributed.placement``. The implementation is
``unison._placement`` (and, for the name hash, the parameter servers'
``unison._ps.remote_variables.name_placement``).
"""

from unison import _deprecation
from unison._placement.config import PlacementConfig
from unison._placement.parameter_servers import subnetwork_ps_group
from unison._placement.strategies import PlacementStrategy, ReplicationStrategy, RoundRobinStrategy
from unison._ps.remote_variables.name_placement import OpNameHashStrategy

__all__ = [
    "PlacementStrategy",
    "ReplicationStrategy",
    "RoundRobinStrategy",
    "PlacementConfig",
    "OpNameHashStrategy",
    "subnetwork_ps_group",
]

__getattr__ = _deprecation.module_getattr(__name__)
