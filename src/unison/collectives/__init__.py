"""Cross-device and cross-process reductions, packing, and the K x N gradient helpers.

The gradient-list helpers follow tensorpack's ``graph_builder/utils.py``: K lists (one
per device) of N gradients.
"""

from unison.collectives.base import CrossDeviceOps
from unison.collectives.gradients import (
    aggregate_grads,
    aggregate_grads_colocate,
    allreduce_grads,
    allreduce_grads_hierarchical,
    allreduce_grads_naive,
    merge_grad_list,
    split_grad_list,
)
from unison.collectives.local import (
    AllReduceCrossDeviceOps,
    HierarchicalCopyAllReduce,
    NcclAllReduce,
    ReductionToOneDevice,
    select_cross_device_ops,
)
from unison.collectives.packing import GradientPacker, TensorPacker, group_by_size
from unison.collectives.placement_utils import LeastLoadedDeviceSetter, OverrideCachingDevice

__all__ = [
    "CrossDeviceOps",
    "ReductionToOneDevice",
    "AllReduceCrossDeviceOps",
    "NcclAllReduce",
    "HierarchicalCopyAllReduce",
    "select_cross_device_ops",
    "allreduce_grads",
    "allreduce_grads_hierarchical",
    "aggregate_grads",
    "aggregate_grads_colocate",
    "allreduce_grads_naive",
    "split_grad_list",
    "merge_grad_list",
    "GradientPacker",
    "TensorPacker",
    "group_by_size",
    "LeastLoadedDeviceSetter",
    "OverrideCachingDevice",
]
