"""CollectiveAllReduce: reductions across the workers' torch.distributed process group.

A batch of values is first reduced in-process over this worker's replicas, then summed
across workers by the cross-worker transport chosen when the ops are built
(``transport/cross_worker.py``: shared memory between the workers of one host, else packed
collectives). Sparse tensors travel by all-gather of indices and values. Every call is
first checked across workers (``WorkerControl.check_call``: shapes, dtypes, reduce op
and call sequence), so a mismatch raises ``CollectiveMismatchError`` on every worker
instead of hanging, producing wrong numbers, or letting gloo abort the process.
"""

from __future__ import annotations

import typing
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from unison._collectives.group.process_group import LazyWorkerGroup, WorkerGroup
from unison._collectives.group.worker_control import WorkerControl
from unison._collectives.ops.base import CrossDeviceOps, Destinations, to_destinations
from unison._collectives.options import CommunicationOptions
from unison._collectives.transport.cross_worker import CrossWorkerTransport, choose_transport
from unison._collectives.transport.packing import TensorPacker
from unison._devices import canonicalize_all, is_cuda, torch_device
from unison._reduce import ReduceOp
from unison._values.values import PerReplica
from unison.errors import CollectiveMismatchError

__all__ = ["CollectiveAllReduce"]


def _local_sum(value: PerReplica) -> torch.Tensor:
    components = value.values
    if len(components) == 1:
        return components[0]  # no copy: callers only read it (the all-reduce packs into a fresh buffer)
    total = components[0].clone()
    for component in components[1:]:
        total = total + component.to(total.device)
    return total


@typing.final
class CollectiveAllReduce(CrossDeviceOps):
    """All-reduce across workers through torch.distributed (``tf.distribute.experimental.CollectiveAllReduce``).

    Built by MultiWorkerMirroredStrategy; can also be made directly over an already
    initialised default process group.

    Args:
        devices: this worker's replica devices.
        worker_group: the group to use; default the initialised default group.
        options: packing, timeout and backend options.
        backend: the group's backend when ``worker_group`` is lazy (default: the formed
            group's); it decides the transport.
        hosts: the host of every rank, when known (``ResolvedCluster.task_hosts``): workers
            on several hosts, some sharing one, get the hierarchical transport.
    """

    def __init__(self, devices: Sequence[str], worker_group: WorkerGroup | LazyWorkerGroup | None = None,
                 options: CommunicationOptions | None = None, *, backend: str | None = None,
                 hosts: Sequence[str] | None = None):
        self._devices = canonicalize_all(devices)
        self._options = options or CommunicationOptions()
        if worker_group is None:
            if not dist.is_initialized():
                raise ValueError(
                    "CollectiveAllReduce needs a torch.distributed process group: call "
                    "dist.init_process_group first, or use MultiWorkerMirroredStrategy, which forms one"
                )
            world = dist.get_world_size()
            worker_group = WorkerGroup(dist.group.WORLD, None, dist.get_rank(), world,
                                       [f"rank:{r}" for r in range(world)], dist.get_backend(),
                                       self._options.effective_timeout, None)
        if backend is None:
            backend = worker_group.backend if isinstance(worker_group, WorkerGroup) else worker_group.get().backend
        device = torch_device(self._devices[0]) if backend == "nccl" else torch.device("cpu")
        self._control = WorkerControl(worker_group, device)
        self._transport = choose_transport(self._control, self._options, backend, hosts,
                                           replicas_on_cuda=any(is_cuda(d) for d in self._devices))

    @property
    def worker_group(self) -> WorkerGroup:
        """The workers' process group (formed on first use)."""
        return self._control.group

    @property
    def control(self) -> WorkerControl:
        """The group's plumbing (waits, control collectives, per-call check), shared with gradient buckets."""
        return self._control

    @property
    def transport(self) -> CrossWorkerTransport:
        """The cross-worker transport chosen for this group."""
        return self._transport

    # -- CrossDeviceOps -------------------------------------------------------------
    def _batch_reduce(self, reduce_op: ReduceOp, pairs: list[tuple[PerReplica, Destinations]]) -> list[Any]:
        local = [value.values[0] if len(value.values) == 1 else _local_sum(value) for value, _ in pairs]
        divisor = self._control.world_size * len(pairs[0][0].values) if reduce_op is ReduceOp.MEAN else 1
        op = reduce_op.value

        def check() -> None:  # the signatures meet in shared memory where the transport has it, as every check's do
            self._control.check_call(local, "batch all-reduce", op, signals=self._transport.call_signals())

        if all(t.layout == torch.strided for t in local):
            reduced = self._transport.all_reduce(local, divisor, check)
        else:
            check()
            dense = [i for i, t in enumerate(local) if t.layout == torch.strided]
            reduced = list(local)
            summed_dense = self._transport.all_reduce([local[i] for i in dense], divisor, lambda: None)
            for i, tensor in zip(dense, summed_dense):
                reduced[i] = tensor
            for i, tensor in enumerate(local):
                if tensor.layout != torch.strided:
                    summed = self.all_reduce_sparse(tensor)
                    assert summed is not None  # this worker's own tensor is in the sum
                    reduced[i] = summed / divisor if divisor != 1 else summed
        destinations = pairs[0][1]
        if (len(destinations) == 1 and destinations[0].startswith("cpu") and all(d is destinations for _, d in pairs)
                and all(t.is_cpu for t in reduced)):
            return reduced  # the usual batch: every result already on the one CPU destination
        return [to_destinations(tensor, destinations) for tensor, (_, destinations) in zip(reduced, pairs)]

    def _all_gather_varying(self, tensor: torch.Tensor, operation: str) -> list[torch.Tensor]:
        """All-gathers tensors whose first dimension differs between workers."""
        sizes = [s[0] for s in self._control.all_gather_ints([tensor.shape[0]], operation)]
        return self._all_gather_sized(tensor, sizes, operation)

    def _all_gather_sized(self, tensor: torch.Tensor, sizes: list[int], operation: str) -> list[torch.Tensor]:
        """All-gathers tensors whose first dimension is ``sizes[rank]`` on each worker (padded to the largest)."""
        control = self._control
        padded = torch.zeros((max(sizes), *tensor.shape[1:]), dtype=tensor.dtype, device=control.device)
        padded[: tensor.shape[0]] = tensor.to(control.device)
        gathered = [torch.empty_like(padded) for _ in sizes]
        control.call(operation, dist.all_gather, gathered, padded)
        return [g[:n] for g, n in zip(gathered, sizes)]

    def all_reduce_sparse(self, tensor: torch.Tensor | None, like: torch.Tensor | None = None) -> torch.Tensor | None:
        """Sums a sparse tensor across workers (all-gather of indices and values).

        ``tensor`` None: this worker has none (a sparse gradient only other workers computed
        this step); it joins the collective with no entries and gets the sum in the shape,
        dtype and device of ``like`` -- None where no worker had one.

        Raises:
            CollectiveMismatchError: when the workers' tensors differ in their number of sparse dimensions.
        """
        operation = "sparse all-reduce"
        if tensor is not None:
            tensor = tensor.coalesce()
            header = [tensor._nnz(), tensor.sparse_dim()]
        elif like is None:
            raise ValueError("all_reduce_sparse(None) needs `like`: the tensor whose shape, dtype and device "
                             "the sum takes")
        else:
            header = [0, -1]  # no entries, and no say in the sparse dimensions
        gathered = self._control.all_gather_ints(header, operation)
        sparse_dims = sorted({dims for _, dims in gathered if dims >= 0})
        if not sparse_dims:
            return None
        if len(sparse_dims) > 1:
            raise CollectiveMismatchError(
                f"sparse all-reduce: the workers' tensors have {sparse_dims} sparse dimensions (by rank: "
                f"{[dims for _, dims in gathered]}); every worker must sum the same kind of sparse tensor"
            )
        sizes = [entries for entries, _ in gathered]
        if tensor is not None:
            shape, device, indices, values = tensor.shape, tensor.device, tensor.indices(), tensor.values()
        else:
            assert like is not None  # checked above
            sparse_dim = sparse_dims[0]
            shape, device = like.shape, like.device
            indices = torch.zeros((sparse_dim, 0), dtype=torch.int64)
            values = torch.zeros((0, *like.shape[sparse_dim:]), dtype=like.dtype)
        all_indices = self._all_gather_sized(indices.t().contiguous(), sizes, operation)
        all_values = self._all_gather_sized(values, sizes, operation)
        return torch.sparse_coo_tensor(
            torch.cat(all_indices).t(), torch.cat(all_values), shape, device=device
        ).coalesce()

    def _gather(self, value: PerReplica, destinations: Destinations, axis: int) -> Any:
        control = self._control
        local = torch.cat([c.to(control.device) for c in value.values], dim=axis)
        moved = local.movedim(axis, 0).contiguous()
        control.check_call([moved[:0]], "gather", "gather", signals=self._transport.call_signals())
        parts = self._all_gather_varying(moved, "gather")
        gathered = torch.cat(parts, dim=0).movedim(0, axis)
        return to_destinations(gathered.to(torch_device(destinations[0])), destinations)

    def agree(self, local_has_data: bool) -> bool:
        """Whether every worker has data (input agreement at the end of a dataset)."""
        return bool(self._control.agree_min(1 if local_has_data else 0, "input agreement"))

    def broadcast_from_chief(self, tensors: Sequence[torch.Tensor]) -> None:
        """Overwrites ``tensors`` in place with the chief's values, in one packed broadcast per dtype."""
        control = self._control
        tensors = [t for t in tensors if t.numel() > 0]
        control.check_call(tensors, "initial broadcast of variables", "broadcast",
                           signals=self._transport.call_signals())
        if not tensors:
            return
        packer = TensorPacker(bytes_per_pack=0)
        packs = packer.pack([[t.detach().to(control.device) for t in tensors]])[0]
        for pack in packs:
            control.call("initial broadcast of variables", dist.broadcast, pack, src=0)
        with torch.no_grad():
            for target, value in zip(tensors, packer.unpack([packs])[0]):
                target.copy_(value)

    def barrier(self) -> None:
        """Waits until every worker arrives (an all-reduce of one element)."""
        self._control.barrier()
