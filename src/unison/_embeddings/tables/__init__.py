"""Embedding tables below the modules: the ``Table`` contract, the local table (one shard's rows,
their id index and optimizer state), row initializers, eviction policies and bag layouts.

Run by every process that holds rows: a one-device trainer holds a whole table, each ps task
one shard per table (``unison._ps.task``). Imports nothing of ``unison`` above ``errors``."""

__all__: list[str] = []
