"""Variables on ps tasks as the chief (and, rebuilt from specs, a worker) sees them: ``PSVariable`` and
``ShardedVariable``, their specs, placement by name, partitioners, the variable policy that makes
parameters built in scope into them, and the optimizer state that lives on the ps."""

__all__: list[str] = []
