"""The ps process: the parameter store (variables and their optimizers), the dynamic table shards,
the dispatch of typed requests to them, and its malloc settings. Runs only on ps tasks."""

__all__: list[str] = []
