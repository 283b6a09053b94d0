"""The ps side: a store of variables (whole or shards) with their optimizer state.

Each ps task holds the tensors placed on it, keyed by a name the coordinator chose.
Workers pull values (whole, or only some rows of a shard) and push gradients; the
store applies the optimizer the worker used (its class and hyper-parameters travel
with the push) to each tensor under that tensor's lock: updates from different
workers interleave freely (asynchronous training) but each is applied whole
(atomic per shard). The optimizer state (momentum, Adam moments) lives here, next to
its tensor.

tf.distribute equivalent: the variables a ``ParameterServerStrategy`` places on
``/job:ps/task:K`` and the ``ResourceApply*`` ops that update them there.
"""

from __future__ import annotations

import copy
import inspect
import threading
from typing import Any

import torch

from unison._embeddings.optim.from_torch import plain_sgd
from unison._ps.task.table_shards import TableShards

__all__ = ["ParameterStore"]


class _Slot:
    __slots__ = ("tensor", "lock", "optimizers")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.lock = threading.Lock()
        self.optimizers: dict[type, torch.optim.Optimizer] = {}


def _make_optimizer(cls: type, tensor: torch.Tensor, hyper: dict) -> torch.optim.Optimizer:
    """``cls`` over ``tensor``, its one group holding the worker's group's hyper-parameters.

    The group carries every key, also those that are no constructor argument: the
    ``initial_lr`` an LR scheduler adds, a user's ``"name"``. The constructor gets the
    arguments it names, for an optimizer that requires one (a custom ``lr`` without default).
    """
    names = [name for name, parameter in inspect.signature(cls).parameters.items()
             if parameter.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    arguments = {name: hyper[name] for name in names[1:] if name in hyper}  # after params
    return cls([{**hyper, "params": [tensor]}], **arguments)


class ParameterStore:
    """The tensors of one ps task and their optimizers; safe for concurrent sessions."""

    def __init__(self, task_index: int = 0) -> None:
        self._slots: dict[str, _Slot] = {}
        self._lock = threading.Lock()
        self.tables = TableShards(f"ps-{task_index}")
        """The shards of dynamic embedding tables on this ps task."""

    def __len__(self) -> int:
        return len(self._slots)

    def _slot(self, key: str) -> _Slot:
        try:
            return self._slots[key]
        except KeyError:
            raise KeyError(f"no variable {key!r} on this ps task; create it in the strategy's scope first") from None

    def create(self, key: str, value: torch.Tensor) -> None:
        """Stores ``value`` under ``key``, replacing what was there (and its optimizer state)."""
        slot = _Slot(value.detach().clone().requires_grad_(False))
        with self._lock:
            self._slots[key] = slot

    def read(self, key: str) -> torch.Tensor:
        """A copy of the whole tensor, taken under its lock (never half-updated)."""
        slot = self._slot(key)
        with slot.lock:
            return slot.tensor.clone()

    def read_into(self, key: str, out: torch.Tensor | None) -> torch.Tensor:
        """Like ``read``, into ``out`` when it has the tensor's shape and dtype (a reused buffer)."""
        slot = self._slot(key)
        with slot.lock:
            tensor = slot.tensor
            if out is None or out.shape != tensor.shape or out.dtype != tensor.dtype:
                return tensor.clone()
            return out.copy_(tensor)

    def read_to(self, key: str, out: torch.Tensor) -> None:
        """Copies the tensor into ``out`` (a worker's parameter in shared memory) under its lock.

        Raises:
            ValueError: if ``out`` has another shape or dtype.
        """
        slot = self._slot(key)
        with slot.lock:
            tensor = slot.tensor
            if out.shape != tensor.shape or out.dtype != tensor.dtype:
                raise ValueError(f"{key!r} is {tuple(tensor.shape)} {tensor.dtype}, "
                                 f"the worker's copy {tuple(out.shape)} {out.dtype}")
            out.copy_(tensor)

    def read_rows(self, key: str, ids: torch.Tensor) -> torch.Tensor:
        """The rows ``ids`` (int64, local to this shard) of the tensor."""
        slot = self._slot(key)
        with slot.lock:
            return slot.tensor.index_select(0, ids)

    def assign(self, key: str, value: torch.Tensor) -> None:
        """Overwrites the tensor's values (keeps its optimizer state)."""
        slot = self._slot(key)
        with slot.lock:
            slot.tensor.copy_(value)

    def add(self, key: str, delta: torch.Tensor) -> None:
        """Adds ``delta`` to the tensor (a worker's change to a buffer or other non-trainable variable).

        Changes from several workers add up, whatever their order: TensorFlow's
        ``assign_add``/``assign_sub`` on a ps variable (BatchNorm's moving averages).
        """
        slot = self._slot(key)
        with slot.lock:
            slot.tensor.add_(delta.to(slot.tensor.dtype).view_as(slot.tensor))

    def apply(self, key: str, grad: torch.Tensor, ids: torch.Tensor | None, cls: type, hyper: dict) -> None:
        """Applies optimizer ``cls`` with ``hyper`` to ``key`` for ``grad`` (of rows ``ids`` when given)."""
        slot = self._slot(key)
        with slot.lock, torch.no_grad():
            tensor = slot.tensor
            if plain_sgd(cls, hyper):  # what SGD.step does, without its per-step machinery
                if ids is None:
                    tensor.add_(grad.to(tensor.dtype).view_as(tensor), alpha=-float(hyper["lr"]))
                else:
                    tensor.index_add_(0, ids, grad.to(tensor.dtype), alpha=-float(hyper["lr"]))
                return
            optimizer = slot.optimizers.get(cls)
            if optimizer is None:
                optimizer = slot.optimizers[cls] = _make_optimizer(cls, tensor, hyper)
            else:
                optimizer.param_groups[0].update(hyper)  # schedulers change lr between steps
            if ids is None:
                tensor.grad = grad.to(tensor.dtype).view_as(tensor)
            else:
                dense = torch.zeros_like(tensor)
                dense.index_add_(0, ids, grad.to(tensor.dtype))
                tensor.grad = dense
            try:
                optimizer.step()
            finally:
                tensor.grad = None

    def optimizer_states(self, key: str) -> dict[type, dict[str, Any]]:
        """A copy of the state each optimizer class keeps for ``key`` here (momentum, Adam's moments)."""
        slot = self._slot(key)
        with slot.lock:
            return {cls: copy.deepcopy(dict(optimizer.state.get(slot.tensor, {})))
                    for cls, optimizer in slot.optimizers.items()}

    def load_optimizer_state(self, key: str, cls: type, hyper: dict, state: dict[str, Any]) -> None:
        """Makes ``state`` the state of optimizer ``cls`` for ``key`` (a checkpoint's, on resume)."""
        slot = self._slot(key)
        with slot.lock:
            optimizer = slot.optimizers.get(cls)
            if optimizer is None:
                optimizer = slot.optimizers[cls] = _make_optimizer(cls, slot.tensor, hyper)
            else:
                optimizer.param_groups[0].update(hyper)
            device = slot.tensor.device
            optimizer.state[slot.tensor] = {name: value.to(device, copy=True) if isinstance(value, torch.Tensor)
                                            else copy.deepcopy(value) for name, value in state.items()}
