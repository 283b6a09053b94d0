"""Methods of process-wide objects that a step calls once, run once per step under several replicas.

A training step often ends with ``scheduler.step()`` (warm-up, OneCycle, cosine per
iteration) or ``ema.update_parameters(model)`` (``torch.optim.swa_utils.AveragedModel``).
Run by every replica thread, the schedule advanced once per replica (2x fast on two
replicas), the average took every step twice (its copy of the model, a deep copy, is one
set of plain tensors that every replica shares), and one replica's change could reach
another's optimizer step of the same iteration. In a replica of a strategy with several
local replicas these calls are merges: once every replica made the call (each past its
``opt.step()``), it runs once, in cross-replica context, as TensorFlow's schedules
advance once per applied step. Per-replica arguments (``ReduceLROnPlateau``'s metric) arrive as
their mean over the replicas: for equal shares of a batch, the whole batch's metric.
``optimizer.add_param_group(group)`` in the step (unfreezing a layer midway) is one too:
the replicas share the optimizer, and a second call would add the group twice.

The methods of ``LRScheduler``, ``AveragedModel`` and ``Optimizer``, and of every subclass that defines
its own (PyTorch's, yours, and those defined later), are wrapped, once, when the first
strategy with several local replicas is made; elsewhere they are PyTorch's. A call
outside ``strategy.run`` is untouched.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler
from torch.optim.swa_utils import AveragedModel

from unison._interpose.grad_scaler import replica_of_several
from unison._interpose.registry import Interposition
from unison._values.values import PerReplica

__all__ = ["install_once_per_step"]

_WRAPPED = "_unison_once_per_step"


def _mean(value: Any) -> Any:
    """A per-replica argument's mean over the replicas (numbers, tensors), else replica 0's; others as they are."""
    if not isinstance(value, PerReplica):
        return value
    values = value.values
    if all(isinstance(v, torch.Tensor) for v in values):
        return sum(v.detach().to(values[0].device) for v in values) / len(values)
    if all(isinstance(v, (int, float)) for v in values):
        return sum(values) / len(values)
    return values[0]


def _call_once(strategy: Any, method: Callable[..., Any], owner: Any, args: tuple, kwargs: dict) -> Any:
    """In cross-replica context: the one call for every replica's."""
    if isinstance(owner, PerReplica):  # one object per replica (made inside run): each is called once
        return PerReplica([method(o, *args, **kwargs) for o in owner.values])
    return method(owner, *map(_mean, args), **{key: _mean(value) for key, value in kwargs.items()})


def _once_per_step(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        context = replica_of_several()
        if context is None:
            return method(self, *args, **kwargs)
        return context.merge_call(_call_once, args=(method, self, args, kwargs))

    setattr(wrapper, _WRAPPED, True)
    return wrapper


def _wrap_own(cls: type, name: str) -> None:
    own = cls.__dict__.get(name)
    if own is not None and not getattr(own, _WRAPPED, False):
        setattr(cls, name, _once_per_step(own))


def _wrap_everywhere(base: type, name: str) -> None:
    """Wraps ``name`` of ``base`` and of every subclass that defines its own, now and later."""
    pending: list[type] = [base]
    while pending:
        cls = pending.pop()
        _wrap_own(cls, name)
        pending.extend(cls.__subclasses__())
    previous = base.__dict__.get("__init_subclass__")

    def init_subclass(cls: type, **kwargs: Any) -> None:  # a subclass defined from now on
        if previous is not None:
            previous.__func__(cls, **kwargs)
        else:
            super(base, cls).__init_subclass__(**kwargs)  # type: ignore[arg-type,misc]
        _wrap_own(cls, name)

    base.__init_subclass__ = classmethod(init_subclass)  # type: ignore[assignment]


def _install() -> None:
    _wrap_everywhere(LRScheduler, "step")
    _wrap_everywhere(AveragedModel, "update_parameters")
    _wrap_everywhere(torch.optim.Optimizer, "add_param_group")


install_once_per_step = Interposition(
    "once-per-step wrappers of step / update_parameters / add_param_group, and __init_subclass__",
    "LRScheduler, AveragedModel, torch.optim.Optimizer and their subclasses",
    "called in every replica thread of a step, they must run once, as on one device", _install)
