"""How bytes move: between the devices of one process, and between workers.

In one process: ``in_process.py`` (the K x N gradient-list all-reduce and aggregation).
Between workers: ``cross_worker.py`` (the transport chosen once for batch reductions:
packed collectives, shared memory, hierarchical) and ``bucket_transports.py`` (how a
gradient synchroniser's buckets travel: the contract, and the ways over the group; those
through a host's shared memory in ``shared_buckets.py``), built from ``packed_all_reduce.py``,
``shared_memory.py`` with its counters in ``shm_signals.py``, ``compression.py`` and
``powersgd.py``. ``packing.py`` and ``flat_buffers.py`` lay many tensors out in a few
buffers for all of them. Transports run over the worker group (``_collectives/group/``)
and never import the CrossDeviceOps that drive them.
"""

__all__: list[str] = []
