"""``unison.embeddings``: embedding tables keyed by any int64 id, for recommendation models.

``DynamicEmbedding`` creates rows on first touch; its rows start from an id-keyed
initializer (``Normal``, ``Uniform``, ``Zeros``: the same row for an id whatever the
order rows are made in) and may be evicted (``EvictUnseen``, ``EvictBelowCount``).
``on_ps`` and ``tables_on_ps`` turn a model's ``nn.Embedding``/``nn.EmbeddingBag`` tables
into such modules (rows on the ps tasks under the parameter-server strategies).
"""

from unison.ps.dynamic_embedding import DynamicEmbedding
from unison.ps.fixed_tables import on_ps, tables_on_ps
from unison.ps.id_initializers import Initializer, Normal, Uniform, Zeros
from unison.ps.row_eviction import EvictBelowCount, EvictionPolicy, EvictUnseen

__all__ = ["DynamicEmbedding", "on_ps", "tables_on_ps", "Initializer", "Normal", "Uniform", "Zeros", "EvictionPolicy", "EvictUnseen",
           "EvictBelowCount"]
