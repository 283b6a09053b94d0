"""Types of ``unison.embeddings``' names, for type checkers; ``__init__.py`` loads each on first use."""

from unison._embeddings.modules.fixed_tables import on_ps, tables_on_ps
from unison._embeddings.serving.export import export_for_serving
from unison._embeddings.serving.exporter import ServingExporter
from unison._embeddings.serving.follower import ServingFollower, ServingSnapshot
from unison._embeddings.serving.serving_embedding import ServingEmbedding
from unison._embeddings.tables.admission_policies import AdmissionPolicy, AdmitAfter, AdmitWithProbability
from unison._embeddings.tables.disk.storage import DiskStorage
from unison._embeddings.tables.eviction import EvictBelowCount, EvictionPolicy, EvictUnseen
from unison._embeddings.tables.initializers import Initializer, Normal, Uniform, Zeros

__all__ = ["on_ps", "tables_on_ps", "Initializer", "Normal", "Uniform", "Zeros", "EvictionPolicy", "EvictUnseen",
           "EvictBelowCount", "AdmissionPolicy", "AdmitAfter", "AdmitWithProbability",
           "export_for_serving", "ServingEmbedding", "ServingExporter", "ServingFollower", "ServingSnapshot",
           "DiskStorage"]
