"""PowerSGD: low-rank gradient all-reduce with error feedback (Vogels et al., 2019).

The algorithm of DDP's ``powerSGD_hook``, over a whole step's gradients at once (every
bucket, after backward): one packed all-reduce of the gradients it leaves exact, one of
every compressed matrix's ``P`` factor, one of every ``Q`` factor. For a gradient matrix
``M`` of ``n x m`` (already divided by the number of workers, so sums are means):

    M += error                       # what earlier steps' approximations missed
    P = M Q;   all-reduce P;   P = orthonormal basis of P
    Q = M^T P; all-reduce Q          # Q, warm-started, is reused next step
    M' = P Q^T;  error = M - M' / workers;  gradient = M'

``n * m`` numbers become ``rank * (n + m)``. Every worker applies the same ``P Q^T``
(both factors are all-reduced); the error stays with each worker. ``M'`` approximates
the *sum* of the workers' ``M``, so each keeps its own ``M`` less its share of ``M'``:
the workers' errors then add up to exactly what the step's update missed, and the next
step's all-reduce pays it back (DDP keeps ``M - M'`` on an undivided ``M``: the same).
A step whose factors are not finite keeps the errors and ``Q`` it started with.
"""

from __future__ import annotations

import typing
from collections.abc import Callable

import torch

from unison._collectives.options import PowerSGD

__all__ = ["PowerSGDReducer"]

AllReduce = Callable[[list[torch.Tensor]], list[torch.Tensor]]
"""Sums a list of dense tensors across the workers; returns the sums in order."""


@typing.final
class PowerSGDReducer:
    """Reduces a step's gradients across workers with PowerSGD (state: errors and ``Q`` per parameter).

    Args:
        config: the user's :class:`PowerSGD` options.
        all_reduce: the packed sum across workers (the same calls on every worker).
        world_size: how many workers take part in ``all_reduce``.
    """

    def __init__(self, config: PowerSGD, all_reduce: AllReduce, world_size: int):
        self.config = config
        self._all_reduce = all_reduce
        self._world_size = world_size
        self._steps = 0
        self._errors: dict[tuple[int, ...], torch.Tensor] = {}  # per batch of same-shaped gradients: [k, n, m]
        self._qs: dict[tuple[int, ...], torch.Tensor] = {}  # per batch: [k, m, rank]

    def _compresses(self, grad: torch.Tensor) -> bool:
        if grad.ndim < 2 or not grad.is_floating_point() or grad.layout != torch.strided:
            return False
        n, m = grad.shape[0], grad.numel() // grad.shape[0]
        rank = min(self.config.rank, n, m)
        return n * m >= self.config.min_compression_rate * rank * (n + m)

    def owed(self, index: int) -> torch.Tensor | None:
        """What this worker still owes of gradient ``index`` (its error feedback), as a matrix; None if nothing."""
        for members, error in self._errors.items():
            if index in members:
                return error[members.index(index)]
        return None

    def reduce(self, grads: list[torch.Tensor], divisor: int) -> None:
        """Replaces each gradient (in place) by its across-worker mean (``divisor`` = workers) or sum (1).

        ``grads`` must be the same parameters' gradients, in the same order, on every worker.
        Gradients of one matrix shape go through the algorithm together, as one batch
        (``bmm``, a batched QR: DDP's ``batch_tensors_with_same_shape``): a model of many
        equal layers costs a few kernels a step, not a few per layer.
        """
        self._steps += 1
        compressed = [] if self._steps <= self.config.start_iter else [
            i for i, g in enumerate(grads) if self._compresses(g)]
        chosen = set(compressed)
        exact = [i for i in range(len(grads)) if i not in chosen]
        sums: list[torch.Tensor] = []
        if exact:
            sums = self._all_reduce([grads[i] / divisor if divisor != 1 else grads[i] for i in exact])
            for i, total in zip(exact, sums):
                grads[i].copy_(total)
        if not compressed:
            return
        shapes: dict[tuple[object, ...], list[int]] = {}
        for i in compressed:
            grad = grads[i]
            shapes.setdefault((grad.shape[0], grad.numel() // grad.shape[0], grad.dtype, grad.device), []).append(i)
        batches = [tuple(members) for members in shapes.values()]
        matrices = []
        for members in batches:
            m = torch.stack([grads[i].reshape(grads[i].shape[0], -1) for i in members])  # a copy: [k, n, m]
            if divisor != 1:
                m.div_(divisor)
            error = self._errors.get(members)
            if error is not None:
                m.add_(error)
            matrices.append(m)
        ps = self._all_reduce([torch.bmm(m, self._q(members, m)) for members, m in zip(batches, matrices)])
        ps = [torch.linalg.qr(p.to(torch.float32)).Q.to(p.dtype) for p in ps]
        qs = self._all_reduce([torch.bmm(m.transpose(1, 2), p) for m, p in zip(matrices, ps)])
        # A gradient that overflowed on any worker (under a GradScaler, whose step then
        # skips) makes an all-reduced Q or sum inf or NaN: such a step leaves the errors
        # and the Qs as they were, as if it never came; else error feedback carried the
        # inf into every later step and the scaler skipped all of them. The all-reduced
        # tensors are the same on every worker, and so is the decision.
        # (One largest magnitude over all of them: inf anywhere makes it inf, a nan propagates
        # through max; a check per tensor cost more than the rest of a step of 200 small layers.)
        everything = torch.cat([t.reshape(-1) for t in (*qs, *sums)])
        finite = everything.numel() == 0 or bool(torch.isfinite(everything.abs().max()))
        for members, m, p, q in zip(batches, matrices, ps, qs):
            approximation = torch.bmm(p, q.transpose(1, 2))
            if finite:
                self._errors[members] = m.sub_(approximation, alpha=1 / self._world_size)  # m is not needed again
                self._qs[members] = q
            for j, i in enumerate(members):
                grads[i].copy_(approximation[j].view_as(grads[i]))

    def _q(self, members: tuple[int, ...], matrices: torch.Tensor) -> torch.Tensor:
        """The warm-started ``Q`` of a batch, or seeded random ones per parameter (equal on every worker)."""
        q = self._qs.get(members)
        columns = matrices.shape[2]
        rank = min(self.config.rank, matrices.shape[1], columns)
        if q is None or q.shape != (len(members), columns, rank):
            fresh = []
            for index in members:
                generator = torch.Generator().manual_seed(self.config.seed * 1_000_003 + index)
                fresh.append(torch.randn(columns, rank, generator=generator, dtype=matrices.dtype))
            q = torch.stack(fresh).to(matrices.device)
        return q
