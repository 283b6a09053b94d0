"""The implementation behind ``unison.embeddings``: embedding tables keyed by any int64 id, for recommendation models.

``DynamicEmbedding`` creates rows on first touch; its rows start from an id-keyed
initializer (``Normal``, ``Uniform``, ``Zeros``: the same row for an id whatever the
order rows are made in) and may be evicted (``EvictUnseen``: a time to live in steps or
seconds; ``EvictBelowCount``) or kept under a capacity (``capacity=``, ``"lru"``/``"lfu"``);
an admission policy (``AdmitAfter``, ``AdmitWithProbability``) gives rows only to ids seen
often enough.
``on_ps`` and ``tables_on_ps`` turn a model's ``nn.Embedding``/``nn.EmbeddingBag`` tables
into such modules (rows on the ps tasks under the parameter-server strategies).

The package has three layers (``tests/architecture/test_layers.py`` keeps them):

- ``modules``: what a model author builds (``DynamicEmbedding``, fixed tables onto the
  ps, the optimizer step hook that trains rows); runs wherever the model runs.
- ``tables``: the :class:`~unison._embeddings.tables.table.Table` contract, the local
  table with its id index, initializers, eviction policies and bag layouts. Every
  process that holds rows runs it: a one-device trainer, and each ps task for its shard
  (``unison._ps`` imports this layer, never ``modules``).
- ``optim``: the row optimizers and the mapping from ``torch.optim`` optimizers to them.

The names below are imported on first use (``lazy_loader``, names and types in
``__init__.pyi``), so that a ps task importing ``unison._embeddings.tables`` does not
import the modules layer above it.
"""

import lazy_loader as _lazy

__getattr__, __dir__, __all__ = _lazy.attach_stub(__name__, __file__)
