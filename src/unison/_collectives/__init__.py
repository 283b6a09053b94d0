"""Cross-device and cross-process reductions, packing, and the K x N gradient helpers.

Four homes, top to bottom: ``ops/`` (the CrossDeviceOps, the public face), ``compat/``
(tensorpack utilities the CrossDeviceOps are not built from), ``transport/`` (how bytes
move) and ``group/`` (the workers' process group and its plumbing); below them all,
``options.py`` (the CommunicationOptions). ``tests/architecture/test_layers.py``
checks that no layer imports a higher one.

The gradient-list helpers follow tensorpack's ``graph_builder/utils.py``: K lists (one
per device) of N gradients. Those the CrossDeviceOps are built from live in
``transport/in_process.py``/``transport/packing.py``; the rest, kept for code ported
from tensorpack, in ``compat/tensorpack.py``.
"""

from unison._collectives.compat.placement import LeastLoadedDeviceSetter
from unison._collectives.compat.tensorpack import (
    GradientPacker,
    OverrideCachingDevice,
    aggregate_grads_colocate,
    allreduce_grads_naive,
    merge_grad_list,
    split_grad_list,
)
from unison._collectives.ops.base import CrossDeviceOps
from unison._collectives.ops.local import (
    AllReduceCrossDeviceOps,
    HierarchicalCopyAllReduce,
    NcclAllReduce,
    ReductionToOneDevice,
    select_cross_device_ops,
)
from unison._collectives.transport.in_process import aggregate_grads, allreduce_grads, allreduce_grads_hierarchical
from unison._collectives.transport.packing import TensorPacker, group_by_size

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
