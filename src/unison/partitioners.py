"""``unison.partitioners``: tf.distribute.experimental.partitioners' spelling of the ps partitioners.

The partitioners live with the parameter servers (``unison._ps.remote_variables.shard_partitioners``); this
module re-exports the public ones under the name TensorFlow users write.
"""

from unison._ps.remote_variables.shard_partitioners import (
    FixedShardsPartitioner,
    MaxSizePartitioner,
    MinSizePartitioner,
    Partitioner,
)

__all__ = ["Partitioner", "FixedShardsPartitioner", "MinSizePartitioner", "MaxSizePartitioner"]
