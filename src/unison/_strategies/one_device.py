"""OneDeviceStrategy: everything on one device (``tf.distribute.OneDeviceStrategy``)."""

from __future__ import annotations

import typing

import torch

from unison._collectives.ops.local import ReductionToOneDevice
from unison._devices import canonicalize
from unison._embeddings.tables.table import LocalTables
from unison._strategies.base import Strategy
from unison._strategies.components import StrategyComponents
from unison._strategies.policies import PlainVariablePolicy
from unison._strategies.replicas import InlineReplicaRunner

__all__ = ["OneDeviceStrategy"]


@typing.final
class OneDeviceStrategy(Strategy):
    """Places variables and computation on a single device.

    Useful to write code once and switch to a distributing strategy later. Module
    parameters built in ``scope()`` move to the device; ``run`` calls the function
    inline, with no thread and no hook, so a step costs what plain PyTorch costs.

    Example:
        >>> strategy = OneDeviceStrategy("cpu:0")
        >>> strategy.run(lambda: torch.ones(2)).sum().item()
        2.0
    """

    def __init__(self, device: str | torch.device):
        self._init_args = (device,)
        name = canonicalize(device)
        super().__init__(StrategyComponents(
            devices=(name,), parameter_devices=(name,), cross_device_ops=ReductionToOneDevice(),
            variable_policy=PlainVariablePolicy(name), runner=InlineReplicaRunner(self, (name,)), tables=LocalTables(),
        ))

    @property
    def cluster_resolver(self) -> None:
        """None: one device of this process."""
        return None
