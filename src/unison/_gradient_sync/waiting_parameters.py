"""Parameters kept aside until used: frozen ones until trainable, late ones until a gradient shows them used.

``nn.Parameter(t, requires_grad=False)`` gets no gradient hook (PyTorch refuses one on
a tensor that does not require grad), and reducing it every step would cost an
all-reduce of zeros for nothing. Left out for good, though, the workers (or replicas)
drifted apart once a program unfroze it. The gradient synchronisers keep such
parameters here, weakly, and take the trainable ones when a step finds some.
"""

from __future__ import annotations

import typing
import weakref
from collections.abc import Callable

import torch

__all__ = ["DormantParameters", "LateParameters"]


@typing.final
class DormantParameters:
    """Weak references to frozen parameters, in registration order."""

    def __init__(self) -> None:
        self._refs: list[weakref.ref[torch.Tensor]] = []

    def __bool__(self) -> bool:
        return bool(self._refs)

    def add(self, param: torch.Tensor) -> None:
        """Keeps ``param`` until it requires grad (or is dropped)."""
        self._refs.append(weakref.ref(param))

    def alive(self) -> list[torch.Tensor]:
        """Every parameter still alive, in registration order; all stay."""
        return [p for ref in self._refs if (p := ref()) is not None]

    def take_all(self) -> list[torch.Tensor]:
        """Every parameter still alive, in registration order; all leave."""
        alive = self.alive()
        self._refs = []
        return alive

    def take_trainable(self) -> list[torch.Tensor]:
        """The parameters that require grad now, in registration order; they leave, as do dropped ones."""
        trainable: list[torch.Tensor] = []
        frozen: list[weakref.ref[torch.Tensor]] = []
        for ref in self._refs:
            param = ref()
            if param is not None:
                if param.requires_grad:
                    trainable.append(param)
                else:
                    frozen.append(ref)
        self._refs = frozen
        return trainable


@typing.final
class LateParameters:
    """Trainable parameters registered after the buckets were built, until one is used.

    A module deep-copied after ``scope()`` (an EMA or teacher copy, ``AveragedModel``)
    or a parameter replaced by ``load_state_dict(..., assign=True)`` joins its strategy
    after the buckets were laid out. Such a parameter joins the buckets once a backward
    gives it a gradient on some worker; one never differentiated (an EMA copy) stays out,
    so its zeros are not all-reduced every step (``benchmarks/RESULTS.md``, 'Late
    parameters stay out until used'). A worker with a gradient for one of them asks
    its peers which are used (one small all-reduce), so every worker enrolls the same;
    a copy used on some workers only, at its first use, fails that step as any
    collective the workers do not all make does.
    """

    def __init__(self) -> None:
        self._waiting = DormantParameters()

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def add(self, param: torch.Tensor) -> None:
        """Keeps ``param`` (weakly) until a gradient shows it is used."""
        self._waiting.add(param)

    def any_used_here(self) -> bool:
        """Whether a waiting parameter has a gradient on this worker (no communication)."""
        return any(p.grad is not None and p.requires_grad for p in self._waiting.alive())

    def take_used(self, fewest_unused: Callable[[list[int]], list[int]]) -> list[torch.Tensor]:
        """The waiting parameters that have a gradient on any worker, in registration order.

        Args:
            fewest_unused: for each position, the smallest of the workers' values (a
                collective); called with 1 where this worker has no gradient, else 0.
        """
        waiting = self._waiting.take_all()
        unused = fewest_unused([int(p.grad is None or not p.requires_grad) for p in waiting])
        for param, idle in zip(waiting, unused):
            if idle:
                self._waiting.add(param)
        return [p for p, idle in zip(waiting, unused) if not idle]
