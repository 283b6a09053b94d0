"""FTRL-Proximal, the optimizer of click-through models, with TensorFlow's argument meanings.

``torch.optim`` has no FTRL, and a model moved from TensorFlow (``tf.keras.optimizers.Ftrl``,
``tf.compat.v1.train.FtrlOptimizer``) should train to the same weights here: so the
arguments mean what TensorFlow's mean, and the update is TensorFlow's, term for term
(checked against TF 2.21's own numbers in ``tests/optim/test_ftrl.py``, made by
``benchmarks/tf_ftrl_reference.py``). :func:`ftrl_update` is that update as a pure
function; :class:`Ftrl` applies it to parameters, and the row optimizer ``RowFtrl``
applies it to the rows of a ``DynamicEmbedding`` (its accumulator and linear terms kept
beside each row).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, final

import torch

__all__ = ["Ftrl", "ftrl_update", "checked_ftrl_arguments", "FTRL_FIELDS"]

FTRL_FIELDS = ("lr", "lr_power", "initial_accumulator_value", "l1", "l2", "l2_shrinkage", "beta")
"""The hyper-parameters of a param group of :class:`Ftrl` (TensorFlow's, in its order)."""


def checked_ftrl_arguments(owner: str, *, lr: Any, lr_power: Any, initial_accumulator_value: Any, l1: Any, l2: Any,
                           l2_shrinkage: Any, beta: Any) -> dict[str, float]:
    """FTRL's hyper-parameters as floats, or a ``ValueError`` naming ``owner``, the field, the value and the fix."""
    given = {"lr": lr, "lr_power": lr_power, "initial_accumulator_value": initial_accumulator_value, "l1": l1,
             "l2": l2, "l2_shrinkage": l2_shrinkage, "beta": beta}
    for field, value in given.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{owner}: `{field}` must be a finite number, got {value!r}; fix: pass a float")
    if lr <= 0:
        raise ValueError(f"{owner}: `lr` (TensorFlow's learning_rate) must be > 0, got {lr!r}; fix: pass a positive "
                         f"learning rate such as lr=0.001")
    if lr_power > 0:
        raise ValueError(f"{owner}: `lr_power` (TensorFlow's learning_rate_power) must be <= 0, got {lr_power!r}; "
                         f"fix: pass -0.5 (the default: step sizes shrink as 1/sqrt(accumulator)) or 0 (a fixed "
                         f"learning rate)")
    for field in ("initial_accumulator_value", "l1", "l2", "l2_shrinkage", "beta"):
        if given[field] < 0:
            raise ValueError(f"{owner}: `{field}` must be >= 0, got {given[field]!r}; fix: pass 0.0 for none or a "
                             f"positive strength")
    return {field: float(value) for field, value in given.items()}


def ftrl_update(weights: torch.Tensor, grads: torch.Tensor, accumulator: torch.Tensor, linear: torch.Tensor, *,
                lr: float, lr_power: float, l1: float, l2: float, l2_shrinkage: float,
                beta: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One FTRL-Proximal step of ``weights`` (any shape; the other tensors alike): new
    ``(weights, accumulator, linear)``. ``linear`` is updated in place.

    TensorFlow's ``ApplyFtrlV2`` with ``beta`` folded into the L2 strength as ``tf.keras`` does::

        g_s    = g + 2 * l2_shrinkage * w                  (the shrinkage gradient)
        n_new  = n + g**2                                  (plain g: shrinkage never enters n)
        z     += g_s - (n_new**-p - n**-p) / lr * w        (p = lr_power)
        w      = (clip(z, -l1, l1) - z) / (n_new**-p / lr + 2 * (l2 + beta / (2 * lr)))

    so ``w`` is 0 where ``|z| <= l1``. With ``p = -0.5`` the powers are square roots, as in
    TensorFlow's kernels.
    """
    l2_total = l2 + beta / (2.0 * lr)
    shrunk = grads.add(weights, alpha=2.0 * l2_shrinkage) if l2_shrinkage else grads
    new_accumulator = accumulator.addcmul(grads, grads)
    if lr_power == -0.5:
        new_power, old_power = new_accumulator.sqrt(), accumulator.sqrt()
    else:
        new_power, old_power = new_accumulator.pow(-lr_power), accumulator.pow(-lr_power)
    linear.add_(shrunk - (new_power - old_power) / lr * weights)
    quadratic = new_power / lr + 2.0 * l2_total
    return (linear.clamp(-l1, l1) - linear) / quadratic, new_accumulator, linear


@final
class Ftrl(torch.optim.Optimizer):
    """FTRL-Proximal (McMahan et al., 2013) with TensorFlow's argument meanings.

    Dense parameters step exactly as ``tf.keras.optimizers.Ftrl`` steps them; a sparse
    gradient (``nn.Embedding(sparse=True)``) steps only the rows it names, on each row's
    summed gradient, as TensorFlow's sparse kernel (``ResourceSparseApplyFtrlV2``) does; over
    a ``DynamicEmbedding``'s ``weight`` handle its rows train the same way, with the
    accumulator and linear terms kept beside each row (``RowFtrl``). The state per
    parameter is ``"accumulator"`` (starting at ``initial_accumulator_value``) and
    ``"linear"`` (starting at 0), TensorFlow's slot names.

    Args:
        params: parameters or param groups.
        lr: the learning rate (TensorFlow's ``learning_rate``), > 0.
        lr_power: how the step size falls as the accumulator grows (``learning_rate_power``),
            <= 0; 0 is a fixed learning rate.
        initial_accumulator_value: where each accumulator starts, >= 0.
        l1: L1 strength (``l1_regularization_strength``), >= 0: weights whose linear term
            stays within ``[-l1, l1]`` are exactly 0.
        l2: L2 strength (``l2_regularization_strength``, the stabilising penalty), >= 0.
        l2_shrinkage: L2 shrinkage (``l2_shrinkage_regularization_strength``, a magnitude
            penalty added to the gradient), >= 0; on sparse gradients only the rows touched shrink.
        beta: the paper's beta, >= 0 (adds ``beta / (2 * lr)`` to the L2 strength).

    Raises:
        ValueError: for ``lr <= 0``, ``lr_power > 0`` or a negative accumulator or strength,
            naming the field and the fix.

    tf.distribute equivalent: ``tf.keras.optimizers.Ftrl`` (no ``weight_decay``/clipping
    arguments: use torch's ``clip_grad_norm_``).

    Example:
        >>> w = torch.nn.Parameter(torch.tensor([0.5, -0.3]))
        >>> opt = Ftrl([w], lr=0.1, l1=0.01)
        >>> (w * torch.tensor([1.0, -2.0])).sum().backward(); opt.step()
        >>> sorted(opt.state[w])
        ['accumulator', 'linear']
    """

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], lr: float = 0.001,
                 lr_power: float = -0.5, initial_accumulator_value: float = 0.1, l1: float = 0.0, l2: float = 0.0,
                 l2_shrinkage: float = 0.0, beta: float = 0.0) -> None:
        defaults = checked_ftrl_arguments("Ftrl", lr=lr, lr_power=lr_power,
                                          initial_accumulator_value=initial_accumulator_value, l1=l1, l2=l2,
                                          l2_shrinkage=l2_shrinkage, beta=beta)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One FTRL step of every parameter with a gradient (of the rows a sparse gradient names)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            hyper = checked_ftrl_arguments("Ftrl", **{name: group[name] for name in FTRL_FIELDS})
            del hyper["initial_accumulator_value"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["accumulator"] = torch.full_like(param, group["initial_accumulator_value"],
                                                           memory_format=torch.preserve_format)
                    state["linear"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                if param.grad.is_sparse:
                    self._sparse_step(param, param.grad, state, hyper)
                    continue
                weights, accumulator, _ = ftrl_update(param, param.grad, state["accumulator"], state["linear"],
                                                      **hyper)
                param.copy_(weights)
                state["accumulator"].copy_(accumulator)
        return loss

    @staticmethod
    def _sparse_step(param: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor],
                     hyper: dict[str, float]) -> None:
        """Steps the rows (along dim 0) a sparse gradient names, on each row's summed gradient."""
        if grad.sparse_dim() != 1:
            raise ValueError(f"Ftrl: a sparse gradient must name rows (sparse_dim 1, as nn.Embedding(sparse=True) "
                             f"gives), got sparse_dim {grad.sparse_dim()}; fix: pass a dense gradient")
        grad = grad.coalesce()
        rows = grad.indices()[0]
        weights, accumulator, linear = ftrl_update(
            param.index_select(0, rows), grad.values(), state["accumulator"].index_select(0, rows),
            state["linear"].index_select(0, rows), **hyper)
        param.index_copy_(0, rows, weights)
        state["accumulator"].index_copy_(0, rows, accumulator)
        state["linear"].index_copy_(0, rows, linear)
