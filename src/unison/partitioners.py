"""``unison.partitioners``: tf.distribute.experimental.partitioners' spelling of the ps partitioners.

The partitioners live with the parameter servers (``unison.ps.partitioners``); this
module re-exports the public ones under the name TensorFlow users write.
"""

from unison.ps.partitioners import FixedShardsPartitioner, MaxSizePartitioner, MinSizePartitioner, Partitioner

__all__ = ["Partitioner", "FixedShardsPartitioner", "MinSizePartitioner", "MaxSizePartitioner"]
