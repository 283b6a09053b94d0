"""Where a replicated variable keeps its components: a component of the variable, not a subclass.

``MirroredStorage`` keeps one copy per replica device (MirroredStrategy,
MultiWorkerMirroredStrategy): the optimizer steps every copy. ``CentralStorage`` keeps
one copy on the parameter device (CentralStorageStrategy): the other replicas read
leaf *aliases* of it, so each records its own gradient, and the optimizer steps once.
A ``MirroredVariable`` is given one of these; the gradient synchroniser asks it whether
replicas step their own copies.
"""

from __future__ import annotations

import abc
import typing
from collections.abc import Sequence

import torch

from unison._devices import torch_device

__all__ = ["VariableStorage", "MirroredStorage", "CentralStorage", "MIRRORED", "CENTRAL"]


class VariableStorage(abc.ABC):
    """How a replicated variable's components relate to its primary tensor (component 0)."""

    @property
    @abc.abstractmethod
    def replicas_step(self) -> bool:
        """Whether every replica's optimizer step writes its own component."""

    @abc.abstractmethod
    def component_devices(self, devices: Sequence[str]) -> tuple[str, ...]:
        """The devices that hold distinct components, given the replica devices."""

    @abc.abstractmethod
    def make_others(self, primary: torch.Tensor, devices: Sequence[str]) -> list[torch.Tensor]:
        """Components 1.. for replicas 1.. (called with subclass dispatch disabled)."""

    @abc.abstractmethod
    def broadcast(self, primary: torch.Tensor, others: Sequence[torch.Tensor]) -> None:
        """Makes every component equal to the primary."""

    @abc.abstractmethod
    def follow_new_data(self, primary: torch.Tensor, others: Sequence[torch.Tensor]) -> None:
        """After the primary's data was replaced (a new dtype, say): the other components get
        data of the same kind, each on its own device (called with subclass dispatch disabled)."""


@typing.final
class MirroredStorage(VariableStorage):
    """One copy per replica device."""

    @property
    def replicas_step(self) -> bool:
        return True

    def component_devices(self, devices: Sequence[str]) -> tuple[str, ...]:
        return tuple(devices)

    def make_others(self, primary: torch.Tensor, devices: Sequence[str]) -> list[torch.Tensor]:
        return [primary.detach().to(torch_device(d), copy=True).requires_grad_(primary.requires_grad)
                for d in devices[1:]]

    def broadcast(self, primary: torch.Tensor, others: Sequence[torch.Tensor]) -> None:
        with torch.no_grad():
            for other in others:
                other.copy_(primary)

    def follow_new_data(self, primary: torch.Tensor, others: Sequence[torch.Tensor]) -> None:
        for other in others:
            other.data = primary.detach().to(other.device, copy=True)


@typing.final
class CentralStorage(VariableStorage):
    """One copy on the parameter device; replicas read aliases of it."""

    @property
    def replicas_step(self) -> bool:
        return False

    def component_devices(self, devices: Sequence[str]) -> tuple[str, ...]:
        return tuple(devices[:1])

    def make_others(self, primary: torch.Tensor, devices: Sequence[str]) -> list[torch.Tensor]:
        return [primary.detach().requires_grad_(primary.requires_grad) for _ in devices[1:]]

    def broadcast(self, primary: torch.Tensor, others: Sequence[torch.Tensor]) -> None:
        """Nothing to copy: every replica reads the same storage."""

    def follow_new_data(self, primary: torch.Tensor, others: Sequence[torch.Tensor]) -> None:
        for other in others:
            other.data = primary.detach()


MIRRORED = MirroredStorage()
CENTRAL = CentralStorage()
