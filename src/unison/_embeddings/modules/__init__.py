"""The embedding modules a model author builds: ``DynamicEmbedding``, fixed tables onto the ps tasks,
and the optimizer step hook that trains rows. Runs wherever the model runs (a one-device trainer,
a worker, the chief); gets its table from the strategy in whose scope it is built."""

__all__: list[str] = []
