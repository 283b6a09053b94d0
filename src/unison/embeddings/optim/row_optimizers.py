"""Optimizers that update only the rows a sparse gradient touches, with per-row state.

A dynamic table's optimizer state lives beside its rows (created, evicted, exported and
re-sharded with them), so an optimizer here is a pure row update: it declares the state
columns it keeps per row and maps ``(rows, summed grads, state)`` of the touched rows to
their new values. The table gathers, calls :meth:`RowOptimizer.update` and scatters back.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from typing import Any, final

import torch

__all__ = ["RowState", "RowOptimizer", "RowSGD", "RowAdagrad", "RowWiseAdagrad"]


@final
@dataclasses.dataclass(frozen=True)
class RowState:
    """One named piece of per-row optimizer state: its column count and starting value."""

    columns: int
    initial: float


def _non_negative(value: Any, field: str, owner: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{owner}: `{field}` must be a finite number >= 0, got {value!r}")
    return float(value)


class RowOptimizer(abc.ABC):
    """A sparse, per-row optimizer step; the table owns the rows and the state."""

    @abc.abstractmethod
    def state_per_row(self, embedding_dim: int) -> dict[str, RowState]:
        """The state this optimizer keeps for each row, by name (empty when it keeps none)."""

    @abc.abstractmethod
    def update(self, rows: torch.Tensor, grads: torch.Tensor,
               state: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """New ``(rows, state)`` of ``k`` distinct rows given their summed gradients.

        Args:
            rows: ``[k, dim]`` current values (a copy: may be changed in place).
            grads: ``[k, dim]`` gradients, duplicates of an id already summed.
            state: each name of :meth:`state_per_row` to its ``[k, columns]`` values (copies).
        """


@final
class RowSGD(RowOptimizer):
    """``row -= lr * grad``: ``torch.optim.SGD`` without momentum or weight decay on sparse gradients."""

    def __init__(self, lr: float) -> None:
        self.lr = _non_negative(lr, "lr", "RowSGD")

    def state_per_row(self, embedding_dim: int) -> dict[str, RowState]:
        return {}

    def update(self, rows: torch.Tensor, grads: torch.Tensor,
               state: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return rows.add_(grads, alpha=-self.lr), {}

    def __repr__(self) -> str:
        return f"RowSGD(lr={self.lr!r})"


@final
class RowAdagrad(RowOptimizer):
    """Elementwise Adagrad, as ``torch.optim.Adagrad`` on sparse gradients (no lr decay or weight decay).

    ``sum += grad**2; row -= lr * grad / (sqrt(sum) + eps)``, with ``sum`` (``dim`` columns
    per row, state name ``"sum"`` as in torch) starting at ``initial_accumulator_value``.
    """

    def __init__(self, lr: float, initial_accumulator_value: float = 0.0, eps: float = 1e-10) -> None:
        self.lr = _non_negative(lr, "lr", "RowAdagrad")
        self.initial_accumulator_value = _non_negative(initial_accumulator_value, "initial_accumulator_value",
                                                       "RowAdagrad")
        self.eps = _non_negative(eps, "eps", "RowAdagrad")

    def state_per_row(self, embedding_dim: int) -> dict[str, RowState]:
        return {"sum": RowState(embedding_dim, self.initial_accumulator_value)}

    def update(self, rows: torch.Tensor, grads: torch.Tensor,
               state: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        total = state["sum"].addcmul_(grads, grads)
        return rows.add_(grads / total.sqrt().add_(self.eps), alpha=-self.lr), {"sum": total}

    def __repr__(self) -> str:
        return (f"RowAdagrad(lr={self.lr!r}, initial_accumulator_value={self.initial_accumulator_value!r}, "
                f"eps={self.eps!r})")


@final
class RowWiseAdagrad(RowOptimizer):
    """Adagrad with one accumulator per row, as TorchRec/FBGEMM's ``EXACT_ROWWISE_ADAGRAD``.

    ``sum += mean(grad**2 over the row); row -= lr / (sqrt(sum) + eps) * grad``: one state
    column per row (``"rowwise_sum"``) instead of ``dim``, for tables where state memory
    matters more than per-coordinate step sizes.
    """

    def __init__(self, lr: float, eps: float = 1e-10, initial_accumulator_value: float = 0.0) -> None:
        self.lr = _non_negative(lr, "lr", "RowWiseAdagrad")
        self.eps = _non_negative(eps, "eps", "RowWiseAdagrad")
        self.initial_accumulator_value = _non_negative(initial_accumulator_value, "initial_accumulator_value",
                                                       "RowWiseAdagrad")

    def state_per_row(self, embedding_dim: int) -> dict[str, RowState]:
        return {"rowwise_sum": RowState(1, self.initial_accumulator_value)}

    def update(self, rows: torch.Tensor, grads: torch.Tensor,
               state: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        total = state["rowwise_sum"].add_(grads.square().mean(dim=1, keepdim=True))
        multiplier = self.lr / total.sqrt().add_(self.eps)
        return rows.sub_(multiplier * grads), {"rowwise_sum": total}

    def __repr__(self) -> str:
        return (f"RowWiseAdagrad(lr={self.lr!r}, eps={self.eps!r}, "
                f"initial_accumulator_value={self.initial_accumulator_value!r})")
