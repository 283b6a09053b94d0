"""MirroredStrategy: synchronous replicas on the devices of one machine (``tf.distribute.MirroredStrategy``)."""

from __future__ import annotations

import typing
from collections.abc import Sequence

import torch

from unison._collectives.ops.base import CrossDeviceOps
from unison._collectives.ops.local import select_cross_device_ops
from unison._devices import canonicalize_all, local_devices
from unison._embeddings.tables.table import NoTables
from unison._gradient_sync.replicas.replica_sync import ReplicaGradientSync
from unison._strategies.base import Strategy
from unison._strategies.components import StrategyComponents
from unison._strategies.policies import ReplicatedVariablePolicy
from unison._strategies.replicas import replica_runner

__all__ = ["MirroredStrategy"]


@typing.final
class MirroredStrategy(Strategy):
    """One replica per device of this machine, kept in sync by all-reduce.

    Variables created in ``scope()`` (and parameters of modules built there) become
    MirroredVariables with one component per device; each replica runs in its own
    thread; ``opt.step()`` inside ``run`` averages gradients over the replicas.

    Args:
        devices: device names (``"cuda:0"``, ``"GPU:1"``, logical ``"cpu:1"``); default
            every CUDA device, else the CPU.
        cross_device_ops: the reduction algorithm; default chosen by
            :func:`select_cross_device_ops`.

    Raises:
        ValueError: for a malformed or duplicate device, or an algorithm that cannot run
            on these devices (``NcclAllReduce`` on CPU).
    """

    def __init__(self, devices: Sequence[str | torch.device] | None = None,
                 cross_device_ops: CrossDeviceOps | None = None):
        self._init_args = (devices, cross_device_ops)
        names = canonicalize_all(devices if devices is not None else local_devices())
        if cross_device_ops is None:
            cross_device_ops = select_cross_device_ops(names)
        elif not isinstance(cross_device_ops, CrossDeviceOps):
            raise TypeError(
                f"cross_device_ops must be a CrossDeviceOps instance, got {type(cross_device_ops).__name__}: "
                f"{cross_device_ops!r}"
            )
        check = getattr(cross_device_ops, "check_devices", None)
        if check is not None:  # also with one device: NCCL on a CPU device is a configuration error
            check(names)
        sync = (ReplicaGradientSync(self, names, cross_device_ops, lambda: self.extended.gradient_reduce_op)
                if len(names) > 1 else None)
        super().__init__(StrategyComponents(
            devices=names, parameter_devices=names, cross_device_ops=cross_device_ops,
            variable_policy=ReplicatedVariablePolicy(self, names, gradient_sync=sync), gradient_sync=sync,
            runner=replica_runner(self, names), tables=NoTables("MirroredStrategy"),
        ))

    @property
    def cluster_resolver(self) -> None:
        """None: the devices of this process."""
        return None
