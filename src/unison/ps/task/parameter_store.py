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
import traceback
from typing import Any

import torch

from unison.embeddings.optim.from_torch import plain_sgd
from unison.ps.wire.shared_arena import MappedSegments
from unison.ps.task.table_shards import TableShards, serve_table_request
from unison.ps.wire.links import TensorLink, pickled, unpickled

__all__ = ["ParameterStore", "serve_ps_session"]


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

    def __init__(self) -> None:
        self._slots: dict[str, _Slot] = {}
        self._lock = threading.Lock()
        self.tables = TableShards()
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

    def read_into(self, key: str, out: "torch.Tensor | None") -> torch.Tensor:
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

    def apply(self, key: str, grad: torch.Tensor, ids: "torch.Tensor | None", cls: type, hyper: dict) -> None:
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


def serve_ps_session(store: ParameterStore, link: TensorLink) -> None:
    """Answers one peer's requests (a worker's or the coordinator's) until it disconnects.

    Requests (header, tensors):
        ("create", keys) + values -> ("ok",)
        ("pull", keys) -> ("ok",) + values
        ("pull_rows", keys) + ids per key -> ("ok",) + rows per key
        ("push", [(key, has_ids)], [(cls, hyper)], [place or None]) + per entry [ids] [grad] -> ("ok",)
            (a dense gradient with a place is read from the worker's shared memory, not sent)
        ("attach", [segment info]) -> ("ok",) + a bool tensor: whether the worker's shared
            segments could be mapped (same host); see :mod:`unison.ps.wire.shared_arena`
        ("pull_shared", keys, places) -> ("ok",), each value copied into the worker's place
        ("assign", keys) + values -> ("ok",)
        ("add", keys) + deltas -> ("ok",)
        ("optimizer_states", keys) -> ("ok",) + one uint8 tensor: the pickled ``optimizer_states`` per key
        ("load_optimizer_states", keys, [(cls, hyper)]) + one uint8 tensor (the pickled states) -> ("ok",)
        ("ping",) -> ("ok",)
        ("table_...", ...): dynamic embedding tables, see :func:`~unison.ps.task.table_shards.serve_table_request`
    Errors come back as ("error", exception, traceback text).
    """
    replies: dict[int, torch.Tensor] = {}  # pull buffers, reused: each is sent before the next request
    shared = MappedSegments()
    try:
        _serve(store, link, replies, shared)
    finally:
        shared.close()


def _serve(store: ParameterStore, link: TensorLink, replies: dict[int, torch.Tensor], shared: MappedSegments) -> None:
    while True:
        try:
            header, tensors = link.recv(reuse=True)  # every request is done with them before the next
        except (EOFError, OSError):
            return
        try:
            reply: list[torch.Tensor] = []
            kind = header[0]
            if kind == "pull":
                reply = [store.read_into(k, replies.get(i)) for i, k in enumerate(header[1])]
                replies.update(enumerate(reply))
            elif kind == "pull_shared":
                for key, place in zip(header[1], header[2]):
                    store.read_to(key, shared.tensor(place))
            elif kind == "attach":
                reply = [torch.tensor([shared.attach(header[1])])]
            elif kind == "pull_rows":
                reply = [store.read_rows(k, ids) for k, ids in zip(header[1], tensors)]
            elif kind == "push":
                position = 0
                places = header[3] if len(header) > 3 else [None] * len(header[1])
                for (key, has_ids), (cls, hyper), place in zip(header[1], header[2], places):
                    ids = tensors[position] if has_ids else None
                    position += 1 if has_ids else 0
                    if place is not None:
                        store.apply(key, shared.tensor(place), ids, cls, hyper)
                        continue
                    store.apply(key, tensors[position], ids, cls, hyper)
                    position += 1
            elif kind == "create":
                for key, value in zip(header[1], tensors):
                    store.create(key, value)
            elif kind == "assign":
                for key, value in zip(header[1], tensors):
                    store.assign(key, value)
            elif kind == "add":
                for key, delta in zip(header[1], tensors):
                    store.add(key, delta)
            elif kind == "optimizer_states":
                reply = [pickled([store.optimizer_states(key) for key in header[1]])]
            elif kind == "load_optimizer_states":
                for key, (cls, hyper), state in zip(header[1], header[2], unpickled(tensors[0])):
                    store.load_optimizer_state(key, cls, hyper, state)
            elif kind.startswith("table_"):
                reply = serve_table_request(store.tables, kind, header, tensors)
            elif kind != "ping":
                raise ValueError(f"unknown ps request {kind!r}")
            message: Any = ("ok",)
        except Exception as e:  # sent back to the requester, which raises it
            message, reply = ("error", e, traceback.format_exc()), []
        try:
            link.send(message, reply)
        except (EOFError, OSError):
            return
        except Exception as e:  # the error itself could not be pickled
            link.send(("error", RuntimeError(repr(e)), ""), [])
