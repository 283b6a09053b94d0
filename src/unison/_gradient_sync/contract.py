"""The gradient synchroniser's contract, beside the step hooks that call it.

A strategy's gradient sync (``BucketedGradientSync``, ``ReplicaGradientSync``, a ps worker's
push) is attached to the parameters it watches; ``opt.step()`` finds it through the step
hooks (:mod:`unison._gradient_sync.step_hooks`), which call only :class:`StepSync`'s two
methods. A strategy also registers parameters, finalizes and suspends it: the whole of
:class:`GradientSync`, which ``unison._strategies.components`` re-exports as one of a
strategy's components.
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["StepSync", "GradientSync"]


@runtime_checkable
class StepSync(Protocol):
    """What ``opt.step()``'s hooks call on the synchroniser of the optimizer's parameters."""

    def pre_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> Any:
        """Runs before ``opt.step()``: completes the reduction; may redirect the step."""
        ...

    def post_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Runs after ``opt.step()``."""
        ...


@runtime_checkable
class GradientSync(StepSync, Protocol):
    """Makes ``backward(); opt.step()`` aggregate gradients over replicas and workers."""

    def register(self, param: torch.Tensor) -> None:
        """Watches a trainable parameter created in scope."""
        ...

    def finalize(self) -> None:
        """Called when new parameters got their initial values (e.g. rebuilds buckets)."""
        ...

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Backward passes inside accumulate without communication."""
        ...

    @property
    def overlap_bucket_bytes(self) -> int | None:
        """The bucket size at which gradients leave while backward runs, else None."""
        ...
