"""Parameters made frozen, waiting until a program makes them trainable.

``nn.Parameter(t, requires_grad=False)`` gets no gradient hook (PyTorch refuses one on
a tensor that does not require grad), and reducing it every step would cost an
all-reduce of zeros for nothing. Left out for good, though, the workers (or replicas)
drifted apart once a program unfroze it. The gradient synchronisers keep such
parameters here, weakly, and take the trainable ones when a step finds some.
"""

from __future__ import annotations

import typing
import weakref

import torch

__all__ = ["DormantParameters"]


@typing.final
class DormantParameters:
    """Weak references to frozen parameters, in registration order."""

    def __init__(self) -> None:
        self._refs: list["weakref.ref[torch.Tensor]"] = []

    def __bool__(self) -> bool:
        return bool(self._refs)

    def add(self, param: torch.Tensor) -> None:
        """Keeps ``param`` until it requires grad (or is dropped)."""
        self._refs.append(weakref.ref(param))

    def take_trainable(self) -> list[torch.Tensor]:
        """The parameters that require grad now, in registration order; they leave, as do dropped ones."""
        trainable: list[torch.Tensor] = []
        frozen: list["weakref.ref[torch.Tensor]"] = []
        for ref in self._refs:
            param = ref()
            if param is not None:
                if param.requires_grad:
                    trainable.append(param)
                else:
                    frozen.append(ref)
        self._refs = frozen
        return trainable
