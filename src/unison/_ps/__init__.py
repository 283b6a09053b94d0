"""Parameter servers: ``ParameterServerStrategy``, ``HybridParameterServerStrategy`` and the processes
they run in.

Sub-packages by role and by the process that runs them, top to bottom (a layer imports only
those below it; ``tests/architecture/test_layers.py`` checks it):

- ``chief``: the chief's coordinator: ``ClusterCoordinator`` (made from a strategy), its
  closure queue, remote values, per-worker datasets; and ``task_server``: ``unison.Server``,
  the standard server of a ps or worker task;
- ``strategy``, ``hybrid_strategy``: the two strategies (the chief's; every hybrid worker's);
- ``worker``: a worker's runtime (its cache of ps variables, pulls, pushes) and the remote
  table, the client side of a ``DynamicEmbedding`` whose rows are on the ps tasks;
- ``remote_variables``: variables placed on ps tasks as the chief sees them, placement by
  name, partitioners, the variable policy, optimizer state kept on the ps;
- ``task``: the ps process: the parameter store, the table shards, the request dispatch;
- ``wire``: what both sides import: the typed protocol, tensor links, the client, same-host
  shared memory.
"""

__all__: list[str] = []  # nothing here: the public names are re-exported by ``unison``
