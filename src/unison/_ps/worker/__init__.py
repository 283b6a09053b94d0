"""A worker's side (run in each worker process): the runtime that caches ps variables, pulls what a
function reads and pushes its gradients; and the remote table, the client half of a dynamic table
whose shards are on the ps tasks (also used by the chief and hybrid workers)."""

__all__: list[str] = []
