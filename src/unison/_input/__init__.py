"""Distributed input: shard datasets across workers and split batches across replicas.

The strategies build :class:`DistributedDataset` (``experimental_distribute_dataset``)
and :class:`DistributedDatasetsFromFunction` (``distribute_datasets_from_function``), both
instances of :class:`DistributedDataset` as in tf.distribute;
users meet :class:`InputContext`, :class:`InputOptions` and :class:`AutoShardPolicy`.
"""

from unison._input.context import AutoShardPolicy, InputContext, InputOptions, InputReplicationMode, ValueContext
from unison._input.dataset import DistributedDataset
from unison._input.from_function import DistributedDatasetsFromFunction
from unison._input.iterator import DistributedIterator, OptionalValue
from unison._input.sampler import ShardedBatchSampler

__all__ = [
    "AutoShardPolicy",
    "InputContext",
    "InputOptions",
    "InputReplicationMode",
    "ValueContext",
    "DistributedDataset",
    "DistributedDatasetsFromFunction",
    "DistributedIterator",
    "OptionalValue",
    "ShardedBatchSampler",
]
