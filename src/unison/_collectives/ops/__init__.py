"""The CrossDeviceOps: tf.distribute's reduction and broadcast algorithms, the public face of collectives.

``base.py`` holds the abstract interface strategies talk to; ``local.py`` the in-process
families over one worker's devices (reduction to one device, all-reduce with packing,
NCCL, hierarchical copy); ``collective.py`` CollectiveAllReduce across the workers'
process group. They compose the layers below: the worker group (``_collectives/group/``)
and the transports (``_collectives/transport/``), which never import them back.
"""

__all__: list[str] = []
