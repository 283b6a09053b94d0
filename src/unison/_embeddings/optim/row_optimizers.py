"""Optimizers that update only the rows a sparse gradient touches, with per-row state.

A dynamic table's optimizer state lives beside its rows (created, evicted, exported and
re-sharded with them), so an optimizer here is a pure row update: it declares the state
columns it keeps per row and maps ``(rows, summed grads, state, step)`` of the touched rows
to their new values. The table gathers, calls :meth:`RowOptimizer.update` and scatters back.

``step`` is the table's optimizer step count ``t``, 1 for the first step: the table's
clock (:attr:`LocalTable.current_step <unison._embeddings.tables.local_table.LocalTable.current_step>`)
plus one. It advances once per optimizer step of the table, rows touched or not, as the
step count ``torch.optim.SparseAdam`` keeps for a parameter does (one per ``opt.step()``),
and travels with the table's checkpoints. Only :class:`RowSparseAdam` reads it (its bias
correction). On ps tasks every push reaches every shard, even one that holds none of
its ids, so each shard's ``t`` is the number of pushes: one function at a time, that is
the one-device count. Under the hybrid strategy each push names its global step, and
``t`` is that step, as on one device on the global batch.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from typing import Any, final

import torch

from unison._optim.ftrl import checked_ftrl_arguments, ftrl_update

__all__ = ["RowState", "RowOptimizer", "RowSGD", "RowAdagrad", "RowWiseAdagrad", "RowSparseAdam", "RowFtrl"]


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
    def update(self, rows: torch.Tensor, grads: torch.Tensor, state: dict[str, torch.Tensor],
               step: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """New ``(rows, state)`` of ``k`` distinct rows given their summed gradients.

        Args:
            rows: ``[k, dim]`` current values (a copy: may be changed in place).
            grads: ``[k, dim]`` gradients, duplicates of an id already summed.
            state: each name of :meth:`state_per_row` to its ``[k, columns]`` values (copies).
            step: the table's optimizer step count ``t`` of this update, >= 1 (see the module).
        """


@final
class RowSGD(RowOptimizer):
    """``row -= lr * grad``: ``torch.optim.SGD`` without momentum or weight decay on sparse gradients."""

    def __init__(self, lr: float) -> None:
        self.lr = _non_negative(lr, "lr", "RowSGD")

    def state_per_row(self, embedding_dim: int) -> dict[str, RowState]:
        return {}

    def update(self, rows: torch.Tensor, grads: torch.Tensor, state: dict[str, torch.Tensor],
               step: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
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

    def update(self, rows: torch.Tensor, grads: torch.Tensor, state: dict[str, torch.Tensor],
               step: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
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

    def update(self, rows: torch.Tensor, grads: torch.Tensor, state: dict[str, torch.Tensor],
               step: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        total = state["rowwise_sum"].add_(grads.square().mean(dim=1, keepdim=True))
        multiplier = self.lr / total.sqrt().add_(self.eps)
        return rows.sub_(multiplier * grads), {"rowwise_sum": total}

    def __repr__(self) -> str:
        return (f"RowWiseAdagrad(lr={self.lr!r}, eps={self.eps!r}, "
                f"initial_accumulator_value={self.initial_accumulator_value!r})")


@final
class RowSparseAdam(RowOptimizer):
    """Adam on the touched rows only, as ``torch.optim.SparseAdam`` on ``nn.Embedding(sparse=True)``.

    Per touched row, with ``t`` the table's step count (see the module)::

        exp_avg    += (1 - beta1) * (grad - exp_avg)
        exp_avg_sq += (1 - beta2) * (grad**2 - exp_avg_sq)
        row        -= lr * sqrt(1 - beta2**t) / (1 - beta1**t) * exp_avg / (sqrt(exp_avg_sq) + eps)

    (``eps`` is added to the uncorrected ``sqrt(exp_avg_sq)``, as SparseAdam does). Rows the
    step did not touch keep their values and moments, while ``t`` advances for all: a row
    made at step ``t`` (or made again after eviction) starts with zero moments and the
    bias correction of ``t``, as a row of an ``nn.Embedding`` first touched at step ``t``.
    State: ``"exp_avg"`` and ``"exp_avg_sq"``, ``dim`` columns each (torch's names).
    """

    def __init__(self, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 maximize: bool = False) -> None:
        self.lr = _non_negative(lr, "lr", "RowSparseAdam")
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"RowSparseAdam: `betas` must be a pair (beta1, beta2), got {betas!r}")
        beta1, beta2 = (_non_negative(beta, f"betas[{k}]", "RowSparseAdam") for k, beta in enumerate(betas))
        if beta1 >= 1 or beta2 >= 1:
            raise ValueError(f"RowSparseAdam: `betas` must lie in [0, 1), got {betas!r}; fix: pass e.g. (0.9, 0.999)")
        self.betas = (beta1, beta2)
        self.eps = _non_negative(eps, "eps", "RowSparseAdam")
        self.maximize = bool(maximize)

    def state_per_row(self, embedding_dim: int) -> dict[str, RowState]:
        return {"exp_avg": RowState(embedding_dim, 0.0), "exp_avg_sq": RowState(embedding_dim, 0.0)}

    def update(self, rows: torch.Tensor, grads: torch.Tensor, state: dict[str, torch.Tensor],
               step: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise ValueError(f"RowSparseAdam.update: `step` must be the table's step count, an int >= 1, got {step!r}")
        beta1, beta2 = self.betas
        grads = -grads if self.maximize else grads
        # SparseAdam's order of operations, so that the rows equal its to the last bit where they can
        exp_avg = state["exp_avg"].add_(grads.sub(state["exp_avg"]).mul_(1 - beta1))
        exp_avg_sq = state["exp_avg_sq"].add_(grads.pow(2).sub_(state["exp_avg_sq"]).mul_(1 - beta2))
        step_size = self.lr * math.sqrt(1 - beta2**step) / (1 - beta1**step)
        rows.add_(-step_size * exp_avg.div(exp_avg_sq.sqrt().add_(self.eps)))
        return rows, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}

    def __repr__(self) -> str:
        return f"RowSparseAdam(lr={self.lr!r}, betas={self.betas!r}, eps={self.eps!r}, maximize={self.maximize!r})"


@final
class RowFtrl(RowOptimizer):
    """FTRL-Proximal on the touched rows only, as TensorFlow's sparse FTRL (``ResourceSparseApplyFtrlV2``).

    Each touched row steps by :func:`~unison._optim.ftrl.ftrl_update` on its summed gradient
    (TensorFlow's optimizers sum a repeated id's gradients before the sparse apply); rows not
    touched do not move, and shrinkage (``l2_shrinkage``) acts on touched rows only. State:
    ``"accumulator"`` (starting at ``initial_accumulator_value``) and ``"linear"`` (at 0),
    ``dim`` columns each. The arguments mean what :class:`unison.optim.Ftrl`'s do.
    """

    def __init__(self, lr: float, lr_power: float = -0.5, initial_accumulator_value: float = 0.1, l1: float = 0.0,
                 l2: float = 0.0, l2_shrinkage: float = 0.0, beta: float = 0.0) -> None:
        hyper = checked_ftrl_arguments("RowFtrl", lr=lr, lr_power=lr_power,
                                       initial_accumulator_value=initial_accumulator_value, l1=l1, l2=l2,
                                       l2_shrinkage=l2_shrinkage, beta=beta)
        self.initial_accumulator_value = hyper.pop("initial_accumulator_value")
        self._hyper = hyper

    def state_per_row(self, embedding_dim: int) -> dict[str, RowState]:
        return {"accumulator": RowState(embedding_dim, self.initial_accumulator_value),
                "linear": RowState(embedding_dim, 0.0)}

    def update(self, rows: torch.Tensor, grads: torch.Tensor, state: dict[str, torch.Tensor],
               step: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        rows, accumulator, linear = ftrl_update(rows, grads, state["accumulator"], state["linear"], **self._hyper)
        return rows, {"accumulator": accumulator, "linear": linear}

    def __repr__(self) -> str:
        hyper = ", ".join(f"{name}={value!r}" for name, value in self._hyper.items())
        return f"RowFtrl({hyper}, initial_accumulator_value={self.initial_accumulator_value!r})"
