"""tensorpack's gradient-list helpers: K lists (one per device) of N gradients, split, merged, reduced and packed.

A gradient list in tensorpack's format (``tensorpack.graph_builder.utils``) is K lists, one
per device ("tower"), of N gradients (or (gradient, variable) pairs), gradient ``n`` of
every list belonging to the same variable. TF graph ops and ``tf.device`` scopes become
eager tensor ops and ``Tensor.to(device)``.

What unison's own strategies are built from (the in-process ``CrossDeviceOps`` and the
parameter-server strategy compose these; they are not a separate copy):

- ``allreduce_grads``, ``allreduce_grads_hierarchical``: every device gets the sum (or
  mean) over the K devices, added in a fixed order so that every device's result is
  bit-identical and equals a plain ``sum``;
- ``aggregate_grads``, ``split_grad_list``: K lists of N (grad, var) pairs to one list of N;
- ``TensorPacker``, ``group_by_size``: K x N tensors packed into K x P flat packs (by count
  or by bytes per pack) and back, as ``AllReduceCrossDeviceOps(num_packs=...)`` and
  ``CommunicationOptions(bytes_per_pack=...)`` do;
- ``LeastLoadedDeviceSetter``: each variable on the ps device with the fewest elements so
  far (``ParameterServerStrategy(variable_placer="least_loaded")``).

Kept for code ported from tensorpack: ``merge_grad_list``, ``aggregate_grads_colocate``,
``allreduce_grads_naive``, ``GradientPacker`` (a fixed number of equal splits) and
``OverrideCachingDevice``.

The implementation is ``unison._collectives`` (``transport/in_process.py``,
``transport/packing.py``, ``compat/``).
"""

from unison._collectives import (
    GradientPacker,
    LeastLoadedDeviceSetter,
    OverrideCachingDevice,
    TensorPacker,
    aggregate_grads,
    aggregate_grads_colocate,
    allreduce_grads,
    allreduce_grads_hierarchical,
    allreduce_grads_naive,
    group_by_size,
    merge_grad_list,
    split_grad_list,
)

__all__ = [
    "allreduce_grads",
    "allreduce_grads_hierarchical",
    "aggregate_grads",
    "split_grad_list",
    "merge_grad_list",
    "aggregate_grads_colocate",
    "allreduce_grads_naive",
    "GradientPacker",
    "TensorPacker",
    "group_by_size",
    "LeastLoadedDeviceSetter",
    "OverrideCachingDevice",
]
