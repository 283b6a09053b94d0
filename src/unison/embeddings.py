"""``unison.embeddings``: embedding tables keyed by any int64 id, for recommendation models.

``DynamicEmbedding`` creates rows on first touch; its rows start from an id-keyed
initializer (``Normal``, ``Uniform``, ``Zeros``: the same row for an id whatever the
order rows are made in) and may be evicted (``EvictUnseen``, ``EvictBelowCount``).
"""

from unison.ps.dynamic_embedding import DynamicEmbedding
from unison.ps.id_initializers import Initializer, Normal, Uniform, Zeros
from unison.ps.row_eviction import EvictBelowCount, EvictionPolicy, EvictUnseen

__all__ = ["DynamicEmbedding", "Initializer", "Normal", "Uniform", "Zeros", "EvictionPolicy", "EvictUnseen",
           "EvictBelowCount"]
