"""Parameter servers: the ps store, worker pulls and pushes, ShardedVariable, partitioners and the closure queue."""

__all__: list[str] = []  # nothing here: import the submodules (the public names are re-exported by ``unison``)
