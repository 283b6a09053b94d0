"""The worker group: forming the workers' process group and keeping it honest.

``process_group.py`` forms the torch.distributed group from a resolved cluster, reaching
the rendezvous store through ``store_connect.py`` under one deadline; ``liveness.py``
names the peers that vanished; ``worker_control.py`` waits on collectives with the
group's timeout, runs the small coordinating collectives and checks that every worker
makes the same call. Batch reductions and gradient buckets share it; it knows nothing
of how their bytes move (``_collectives/transport/``) or of the CrossDeviceOps.
"""

__all__: list[str] = []
