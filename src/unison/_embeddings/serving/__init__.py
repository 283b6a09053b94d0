"""Serving a trained table: an export of ids and rows (full or delta) and a read-only module that answers lookups.

``files`` is the on-disk format, ``export`` writes it from a trained ``DynamicEmbedding``
(wherever its rows live), ``serving_embedding`` reads it in a serving process that never
trains (it imports no strategy and no parameter server). For online training,
``snapshots`` is the layout of a directory of numbered snapshots (every table's export and
the dense state at one moment), ``exporter`` writes them from the training loop every few
seconds and ``follower`` applies each in a serving process as it appears.
"""
