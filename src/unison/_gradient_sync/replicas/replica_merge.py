"""The replica merge: every replica's gradients gathered, reduced, and written back to each component.

It runs inside a ``merge_call`` (one thread, while the other replicas wait), asked by
``ReplicaGradientSync`` (``replica_sync.py``, which decides *when*: a replica's backward
pass ends, or its step begins). Each variable's gradients are reduced across the
replicas (mean by default, ``strategy.extended.gradient_reduce_op``; across workers
too for a multi-worker strategy with several local devices) and every component gets
the result, so code between ``backward()`` and ``opt.step()`` (gradient clipping) sees
reduced gradients, as with DDP.

CPU replicas with their own storage and the default reduction reduce in place
(the ops' ``in_place_reduction``), their small gradients from one flat buffer per replica and
dtype (``replica_grad_buffers.py``); anything else goes through the CrossDeviceOps.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Sequence

import torch

from unison._collectives.ops.base import CrossDeviceOps
from unison._collectives.ops.in_place_reduction import InPlaceReduction
from unison._gradient_sync.replicas.replica_grad_buffers import ReplicaGradBuffers
from unison._reduce import ReduceOp
from unison._values.storage import MIRRORED, VariableStorage
from unison._values.values import Mirrored, PerReplica
from unison._values.variables import DistributedVariable
from unison.errors import CollectiveMismatchError

__all__ = ["ReplicaGradientMerge"]


@typing.final
class ReplicaGradientMerge:
    """Reduces distributed variables' gradients across this worker's replicas (and workers).

    Every method runs in a merge (every replica waiting), except ``install_buffers``,
    which a replica calls in its own thread at the first gradient of its backward pass.

    Args:
        devices: the replica devices.
        cross_device_ops: reduces the gradients (across workers too, for a multi-worker
            strategy with several local devices).
        reduce_op: returns the current gradient ReduceOp (MEAN or SUM); read at each merge.
        storage: where the variables keep their components.
        across_workers: ``cross_device_ops`` also reduces across workers: every worker
            then reduces every variable, since a gradient this worker lacks may exist on
            another (see ``reduce``).
    """

    def __init__(self, devices: Sequence[str], cross_device_ops: CrossDeviceOps,
                 reduce_op: Callable[[], ReduceOp], *, storage: VariableStorage = MIRRORED,
                 across_workers: bool = False):
        self._devices = tuple(devices)
        self._num_replicas = len(self._devices)
        self._cross_device_ops = cross_device_ops
        self._reduce_op = reduce_op
        self._across_workers = across_workers
        # Replicas with their own storage whose ops can reduce in place (CPU replicas, the
        # default reduction: see _reduce_in_place); anything else goes through the ops.
        self._in_place = storage is MIRRORED and cross_device_ops.in_place_reduction(ReduceOp.SUM,
                                                                                     self._devices) is not None
        # ... and their gradients live in one flat buffer per replica and dtype (replica_grad_buffers.py)
        self._buffers = ReplicaGradBuffers(self._num_replicas) if self._in_place else None

    @property
    def in_place(self) -> bool:
        """Whether the gradients are reduced in place (CPU replicas, own storage, default reduction)."""
        return self._in_place

    @property
    def buffers(self) -> ReplicaGradBuffers | None:
        """The replicas' flat gradient buffers, or None where the reduction is not in place."""
        return self._buffers

    def install_buffers(self, replica_id: int, variables: Sequence[DistributedVariable], key: object) -> None:
        """Points replica ``replica_id``'s gradients at its flat buffers, where there are some.

        ``key`` identifies ``variables`` (the registrations so far and the live count), so
        the buffers keep their layout while it does not change."""
        if self._buffers is not None:
            self._buffers.install(replica_id, variables, key)

    def reduce_registered(self, variables: list, key: object,
                          woken: Sequence[torch.Tensor] = ()) -> InPlaceReduction | None:
        """Reduces the gradients of the live registered ``variables`` (identified by ``key``,
        as for ``install_buffers``) and of ``woken`` (variables trainable since they were
        registered): those in the replicas' flat buffers there, the others through ``reduce``.

        Reductions in place are collected and run here, or, when they are large, returned
        for every replica to run its slice of after the merge."""
        reduction = self._in_place_reduction() if self._in_place else None
        if self._buffers is not None:
            rest = self._buffers.reduce(variables, key, self._reduce_op() is ReduceOp.MEAN, reduction)
            if rest is not None:
                variables = rest  # the variables the buffers do not hold (large gradients)
        self.reduce([*variables, *woken] if woken else variables, reduction)
        if reduction is None or reduction.split:
            return reduction
        reduction.run()
        return None

    def reduce(self, params: list, reduction: InPlaceReduction | None = None) -> None:
        """Reduces the variables' gradients across replicas (and workers); those reduced in
        place join ``reduction`` when one is given.

        A variable no local replica has a gradient for is left alone, unless the reduction
        spans workers: then another worker may have one, and every worker must reduce the
        same tensors, so its gradients go as zeros, with a flag per variable and replica
        (1 where a gradient existed) reduced in the same call. A variable whose flags sum
        to zero had a gradient nowhere and keeps none, as on one device.
        """
        devices = self._devices
        n = self._num_replicas
        across = self._across_workers
        targets: list[DistributedVariable] = []
        per_param: list[tuple[torch.Tensor, ...]] = []
        made: list[int] = []
        nowhere_here: list[int] = []  # across workers: targets no local replica had a gradient for
        present: list[list[float]] = [[] for _ in range(n)]
        # One subclass-dispatch switch for the whole walk (not one per component): this
        # runs every step, on every variable.
        with torch._C.DisableTorchFunctionSubclass():
            variables = [p for p in params if isinstance(p, DistributedVariable)]
            # the gradients replica by replica, then variable by variable (list comprehensions:
            # a third of the Python time of a loop per variable, on 400 variables)
            by_replica = [[v.component(i).grad for v in variables] for i in range(n)]
            missing = {k for grads in by_replica for k, g in enumerate(grads) if g is None}
            for k, maybe_grads in enumerate(zip(*by_replica)):
                if across:
                    for i, g in enumerate(maybe_grads):
                        present[i].append(0.0 if g is None else 1.0)
                if k in missing:
                    if all(g is None for g in maybe_grads):
                        if not across:
                            continue
                        nowhere_here.append(len(targets))
                    made.append(len(targets))
                    param = variables[k]
                    maybe_grads = tuple(g if g is not None else torch.zeros_like(param.component(i).detach())
                                        for i, g in enumerate(maybe_grads))
                targets.append(variables[k])
                per_param.append(maybe_grads)
        if not targets:
            return
        if self._in_place and self._reduce_in_place(per_param, reduction):
            for k in made:  # gradients made as zeros above become the components'
                for i, grad in enumerate(per_param[k]):
                    if targets[k].component_grad(i) is not grad:
                        targets[k].set_component_grad(i, grad)
            return
        pairs = [(PerReplica(grads), devices) for grads in per_param]
        if across:  # the same on every worker: the flags go whether or not this one needs them
            flags = [torch.tensor(present[i], dtype=torch.float32, device=devices[i]) for i in range(n)]
            pairs.append((PerReplica(flags), devices))
        try:
            reduced = self._cross_device_ops.batch_reduce(self._reduce_op(), pairs)
        except CollectiveMismatchError as exc:
            if across and (made or any(g.layout != torch.strided for grads in per_param for g in grads)):
                raise CollectiveMismatchError(
                    f"{exc}. If a sparse gradient (nn.Embedding(sparse=True)) was computed on some workers "
                    f"only in this step: that is not supported with several local devices per worker (a "
                    f"worker without one sends dense zeros). Use the embedding on every worker in every "
                    f"step, or run one device per worker, where it is summed on every worker"
                ) from exc
            raise
        nowhere: set[int] = set()
        if across:
            summed = reduced.pop()
            if nowhere_here:  # read only when needed: on a GPU the read waits for the reduction
                sums = (summed.values[0] if isinstance(summed, Mirrored) else summed).tolist()
                nowhere = {t for t in nowhere_here if sums[t] == 0}
        for t, (param, result) in enumerate(zip(targets, reduced)):
            if t in nowhere:
                continue  # no replica of any worker had a gradient: none, as on one device
            reduced_grads = result.values if isinstance(result, Mirrored) else (result,)
            for i in range(self._num_replicas):
                param.set_component_grad(i, reduced_grads[i])

    def _in_place_reduction(self) -> InPlaceReduction:
        """The cross-device ops' in-place reduction for this merge's ReduceOp (``in_place`` only)."""
        reduction = self._cross_device_ops.in_place_reduction(self._reduce_op(), self._devices)
        assert reduction is not None, "in place only where the cross-device ops reduce in place"
        return reduction

    def _reduce_in_place(self, per_param: list[tuple[torch.Tensor, ...]],
                         reduction: InPlaceReduction | None = None) -> bool:
        """Reduces CPU replicas' gradients into the gradients themselves; False if it cannot.

        The replicas share the host's memory, so there is nothing to move: replica 0's
        gradient becomes the sum (in replica order, as ReductionToOneDevice adds), is
        divided for MEAN, and is copied into the others' gradients -- three foreach calls
        whatever the number of parameters, no allocation, two passes fewer over the bytes
        than packing into new buffers (``in_place_reduction.py``; as part of ``reduction``
        when one is given). Gradients that require grad (``create_graph``), are sparse or
        not floating point, or share a tensor, take the general path.
        """
        grads = [g for values in per_param for g in values]
        if any(g.requires_grad or g.layout != torch.strided or not g.is_cpu
               or not (g.is_floating_point() or g.is_complex()) for g in grads):
            return False
        if len({id(g) for g in grads}) != len(grads):
            return False
        here = reduction if reduction is not None else self._in_place_reduction()
        for values in per_param:
            here.add(values)
        if reduction is None:
            here.run()
        return True
