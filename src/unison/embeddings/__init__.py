"""Embedding tables keyed by any int64 id, for recommendation models: the policies and initializers of
``unison.DynamicEmbedding``, and fixed tables onto the parameter servers.

``unison.DynamicEmbedding`` creates rows on first touch. Its rows start from an id-keyed
initializer (``Normal``, ``Uniform``, ``Zeros``, or an ``Initializer`` of your own: the
same row for an id whatever order rows are made in) and may be evicted
(``EvictUnseen``, ``EvictBelowCount``, or an ``EvictionPolicy`` of your own). ``on_ps``
and ``tables_on_ps`` turn a model's ``nn.Embedding``/``nn.EmbeddingBag`` tables into such
modules (rows on the ps tasks under the parameter-server strategies). ``export_for_serving``
writes a trained table's ids and rows (full, or what changed since the previous export) and
``ServingEmbedding`` serves them read-only in one process, applying later delta exports in place.
For online training, ``ServingExporter`` publishes a training model's tables and dense state
as numbered snapshots every few seconds and ``ServingFollower`` serves the newest one in
another process (``ServingSnapshot``: one applied, with its lag).

Each name is imported on first use (names and types in ``__init__.pyi``). The
implementation is ``unison._embeddings``: ``modules`` (what a model author builds),
``tables`` (the table contract and the local table that ps tasks run too), ``optim``
(the row optimizers) and ``serving`` (the serving export and the module that reads it).
"""

from unison import _deprecation, _facades

_stub_getattr, __dir__, __all__ = _facades.attach_stub(__name__, __file__)
__getattr__ = _deprecation.module_getattr(__name__, _stub_getattr)
