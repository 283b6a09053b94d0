from .modules.dynamic_embedding import DynamicEmbedding
from .modules.fixed_tables import on_ps, tables_on_ps
from .tables.admission_policies import AdmissionPolicy, AdmitAfter, AdmitWithProbability
from .tables.disk.storage import DiskStorage
from .tables.eviction import EvictBelowCount, EvictionPolicy, EvictUnseen
from .tables.initializers import Initializer, Normal, Uniform, Zeros

__all__ = ["DynamicEmbedding", "on_ps", "tables_on_ps", "Initializer", "Normal", "Uniform", "Zeros", "EvictionPolicy",
           "EvictUnseen", "EvictBelowCount", "AdmissionPolicy", "AdmitAfter", "AdmitWithProbability", "DiskStorage"]
