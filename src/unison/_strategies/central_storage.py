"""CentralStorageStrategy: variables on one device, compute on several
(``tf.distribute.experimental.CentralStorageStrategy``)."""

from __future__ import annotations

import typing
from collections.abc import Sequence

import torch

from unison._collectives.ops.local import ReductionToOneDevice
from unison._devices import canonicalize, canonicalize_all, local_devices, torch_device
from unison._embeddings.tables.table import NoTables
from unison._gradient_sync.replicas.replica_sync import ReplicaGradientSync
from unison._strategies.base import Strategy
from unison._strategies.components import StrategyComponents
from unison._strategies.policies import ReplicatedVariablePolicy
from unison._strategies.replicas import replica_runner
from unison._values.storage import CENTRAL

__all__ = ["CentralStorageStrategy"]


@typing.final
class CentralStorageStrategy(Strategy):
    """Keeps each variable once, on the parameter device; replicas compute on their devices.

    Gradients of all replicas are reduced onto the parameter device and the optimizer
    steps once there.

    Args:
        compute_devices: replica devices; default every CUDA device, else the CPU.
        parameter_device: where variables live; default the CPU with several compute
            devices, else the one compute device.

    Raises:
        ValueError: for malformed or duplicate devices, or compute devices on another
            physical device than the parameters (not supported yet: replicas would need
            a copy of every variable refreshed after each step).
    """

    def __init__(self, compute_devices: Sequence[str | torch.device] | None = None,
                 parameter_device: str | torch.device | None = None):
        self._init_args = (compute_devices, parameter_device)
        compute = canonicalize_all(compute_devices if compute_devices is not None else local_devices(),
                                   field="compute_devices")
        if parameter_device is None:
            parameter = "cpu:0" if len(compute) > 1 else compute[0]
        else:
            parameter = canonicalize(parameter_device)
        remote = [d for d in compute if torch_device(d) != torch_device(parameter)]
        if remote:
            raise ValueError(
                f"compute_devices {remote!r} are on another physical device than parameter_device "
                f"{parameter!r}: unison's CentralStorageStrategy keeps compute and parameters on one "
                f"physical device (logical CPU devices, or one GPU); use MirroredStrategy across GPUs"
            )
        ops = ReductionToOneDevice()
        sync = (ReplicaGradientSync(self, compute, ops, lambda: self.extended.gradient_reduce_op, storage=CENTRAL)
                if len(compute) > 1 else None)
        super().__init__(StrategyComponents(
            devices=compute, parameter_devices=(parameter,), cross_device_ops=ops,
            variable_policy=ReplicatedVariablePolicy(self, (parameter, *compute[1:]), gradient_sync=sync,
                                                     storage=CENTRAL),
            gradient_sync=sync, runner=replica_runner(self, compute), tables=NoTables("CentralStorageStrategy"),
        ))

    @property
    def cluster_resolver(self) -> None:
        """None: the devices of this process."""
        return None
