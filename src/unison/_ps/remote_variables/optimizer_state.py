"""An optimizer's state on the coordinator is the state its ps tasks keep.

Under parameter servers the optimizer steps on the ps tasks, where each variable's
momentum or Adam moments live next to it (``store.ParameterStore.apply``); the
coordinator's optimizer never steps, so its own ``state`` stays empty. Saved as it was,
a checkpoint of ``optimizer.state_dict()`` held no state, and a resumed run restarted
every moment at zero, silently. Here, for an optimizer over ps variables,
``state_dict()`` reads each variable's state from its ps tasks (a sharded variable's
shards joined along axis 0, as its values are), and ``load_state_dict()`` writes the
loaded state there, so a checkpoint round-trips as on one device and loads into a
plain optimizer, or from one.

Installed once, when the first ``ParameterServerStrategy`` is made; an optimizer over
no ps variable is untouched.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from unison._interpose.optimizer_hooks import optimizer_state_wrappers
from unison._ps.remote_variables.ps_variables import _RemoteParameter
from unison.errors import UsageError

__all__ = ["install_optimizer_state_on_ps"]


def _remote_parameters(optimizer: torch.optim.Optimizer) -> list[tuple[int, _RemoteParameter, dict]]:
    """``(index in the state dict, ps variable, its group)`` for the optimizer's ps variables
    that are on their ps tasks (from the end of the ``scope()`` that made them)."""
    found, index = [], 0
    for group in optimizer.param_groups:
        for param in group["params"]:
            if isinstance(param, _RemoteParameter) and param._ps_remote:
                found.append((index, param, group))
            index += 1
    return found


def _refuse_local(optimizer: torch.optim.Optimizer) -> None:
    """A state loaded before the variables reach their ps tasks would stay on the coordinator."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if isinstance(param, _RemoteParameter) and not param._ps_remote:
                raise UsageError(
                    f"optimizer.load_state_dict() inside the ParameterServerStrategy scope that made its "
                    f"variables ({param._ps_spec.name!r} is not on its ps task yet): the state would stay on "
                    f"the coordinator, which never steps; load it after the `with strategy.scope():` block"
                )


def _joined(pieces: list[dict[str, Any]], rows: int) -> dict[str, Any]:
    """A sharded variable's state from its shards' (in row order): per-row tensors joined."""
    state = {}
    for name, first in pieces[0].items():
        values = [piece[name] for piece in pieces]
        if isinstance(first, torch.Tensor) and first.dim() >= 1 and sum(v.shape[0] for v in values) == rows:
            state[name] = torch.cat(values, dim=0)
        else:
            state[name] = first  # per shard alike (Adam's step count)
    return state


def _split(state: dict[str, Any], part_rows: list[int]) -> list[dict[str, Any]]:
    """The inverse of ``_joined``: each shard's piece of ``state``."""
    rows = sum(part_rows)
    pieces: list[dict[str, Any]] = [{} for _ in part_rows]
    for name, value in state.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == rows:
            for piece, chunk in zip(pieces, torch.split(value, part_rows, dim=0)):
                piece[name] = chunk
        else:
            for piece in pieces:
                piece[name] = value
    return pieces


def _state_dict(original: Callable[..., dict]) -> Callable[..., dict]:
    @functools.wraps(original)
    def state_dict(self: torch.optim.Optimizer) -> dict:
        saved = original(self)
        remote = _remote_parameters(self)
        if not remote:
            return saved
        placed = [(part.task, part.key) for _, param, _ in remote for part in param._ps_spec.parts]
        states = iter(remote[0][1]._ps_owner.client.optimizer_states(placed))
        for index, param, _ in remote:
            spec = param._ps_spec
            pieces = [next(states).get(type(self)) for _ in spec.parts]
            if any(piece is None or not piece for piece in pieces):
                continue  # no step of this optimizer reached the variable yet (or it keeps no state)
            saved["state"][index] = pieces[0] if len(pieces) == 1 else _joined(pieces, spec.shape[0])
        return saved

    return state_dict


def _load_state_dict(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def load_state_dict(self: torch.optim.Optimizer, state_dict: dict) -> None:
        if state_dict.get("state"):
            _refuse_local(self)
        original(self, state_dict)
        remote = _remote_parameters(self)
        entries: list[tuple[int, str, type, dict, dict[str, Any]]] = []
        for _, param, group in remote:
            state = self.state.pop(param, None)  # the coordinator keeps none: the ps tasks step
            if not state:
                continue
            hyper = {key: value for key, value in group.items() if key != "params"}
            parts = param._ps_spec.parts
            pieces = [state] if len(parts) == 1 else _split(state, [part.rows for part in parts])
            entries.extend((part.task, part.key, type(self), hyper, piece) for part, piece in zip(parts, pieces))
        if entries:
            remote[0][1]._ps_owner.client.load_optimizer_states(entries)

    return load_state_dict


def install_optimizer_state_on_ps() -> None:
    """Wraps ``Optimizer.state_dict``/``load_state_dict`` (once; ``_interpose/optimizer_hooks.py``)."""
    optimizer_state_wrappers(state_dict=_state_dict, load_state_dict=_load_state_dict)
