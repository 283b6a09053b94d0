"""Learning-rate schedulers stepped inside a step that several replica threads run at once.

A training step often ends with ``scheduler.step()`` (warm-up, OneCycle, cosine per
iteration). Run by every replica thread, it advanced the schedule once per replica (2x
fast on two replicas), and one replica's change could reach another's optimizer step of
the same iteration. In a replica of a strategy with several local replicas,
``scheduler.step()`` is a merge: once every replica called it (each past its
``opt.step()``), it runs once, in cross-replica context, as TensorFlow's schedules advance
once per applied step. Per-replica arguments (``ReduceLROnPlateau``'s metric) arrive as
their mean over the replicas: for equal shares of a batch, the whole batch's metric.

The ``step`` of ``LRScheduler`` and of every subclass that defines its own (PyTorch's and
those defined before the first strategy with several local replicas) is wrapped, once;
elsewhere it is PyTorch's. A scheduler stepped outside ``strategy.run`` is untouched.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch.optim.lr_scheduler import LRScheduler

from unison._once import Once
from unison.gradient_sync.grad_scaler import replica_of_several
from unison.values.values import PerReplica

__all__ = ["install_scheduler_replicas"]

_WRAPPED = "_unison_once_per_step"


def _mean(value: Any) -> Any:
    """A per-replica argument's mean over the replicas (a number or a tensor); else itself."""
    if not isinstance(value, PerReplica):
        return value
    values = value.values
    if all(isinstance(v, torch.Tensor) for v in values):
        return sum(v.detach().to(values[0].device) for v in values) / len(values)
    return sum(float(v) for v in values) / len(values)


def _step_once(strategy: Any, step: Callable[..., Any], scheduler: Any, args: tuple, kwargs: dict) -> Any:
    """In cross-replica context: one step of the schedule for every replica's call."""
    if isinstance(scheduler, PerReplica):  # one scheduler per replica (made inside run): each steps once
        return PerReplica([step(s, *args, **kwargs) for s in scheduler.values])
    return step(scheduler, *map(_mean, args), **{key: _mean(value) for key, value in kwargs.items()})


def _once_per_step(step: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(step)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        context = replica_of_several()
        if context is None:
            return step(self, *args, **kwargs)
        return context.merge_call(_step_once, args=(step, self, args, kwargs))

    setattr(wrapper, _WRAPPED, True)
    return wrapper


def _install() -> None:
    pending: list[type] = [LRScheduler]
    while pending:
        cls = pending.pop()
        own = cls.__dict__.get("step")
        if own is not None and not getattr(own, _WRAPPED, False):
            setattr(cls, "step", _once_per_step(own))
        pending.extend(cls.__subclasses__())


install_scheduler_replicas = Once(_install)
