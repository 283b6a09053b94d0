"""A worker's side of the ps variables: its cache of parameters, pulls and pushes.

A scheduled function arrives pickled; each ps variable in it is rebuilt from its spec
as this worker's cached copy (:meth:`WorkerRuntime.resolve`), and noted as touched.
Before the function runs, every touched whole variable is pulled in one request per ps
task, straight into the cached parameters, so the forward pass runs on plain
``nn.Parameter`` tensors at plain PyTorch speed. A sharded variable (or a whole one of
``LAZY_BYTES`` or more) is a :class:`WorkerShardedParameter`: an embedding lookup pulls
only the rows of its batch; any other use pulls the whole tensor.

A function's changes to non-trainable whole variables (module buffers such as
BatchNorm's running statistics, counters made with ``unison.Variable(trainable=False)``)
go to the ps tasks when it returns, as the difference to what was pulled, added there
(one request per ps task): concurrent workers' changes add up, as TensorFlow's
``assign_add``/``assign_sub`` on ps variables do; a bool variable is assigned.

``optimizer.step()`` on the worker does not update locally: the optimizer step
pre-hook (:mod:`unison._gradient_sync.step_hooks`) finds this worker's gradient sync on the
parameters and pushes every gradient (whole, or only the touched rows) with the
optimizer's class and hyper-parameters, one request per ps task; then the local
gradients are cleared so the local step has nothing to do.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_map
from torch.utils.weak import WeakIdKeyDictionary

from unison._embeddings.tables.distinct_ids import distinct_ids
from unison._gradient_sync.step_hooks import attach, install_step_hooks
from unison._input.context import InputContext
from unison._ps.remote_variables.variable_specs import VariableSpec, is_metadata_function
from unison._ps.wire import protocol as wire
from unison._ps.wire.client import PSClient
from unison._ps.wire.worker_references import WorkerReference, reference

__all__ = ["build_dataset", "WorkerRuntime", "WorkerShardedParameter", "RUNTIME"]

_EMBEDDING = inspect.signature(F.embedding)

#: A whole variable this large is not pulled up front either: like a sharded one, an
#: embedding lookup pulls only its rows, and any other use pulls it when used.
LAZY_BYTES = 32 << 20


def _is_lazy(spec: VariableSpec) -> bool:
    numel = 1
    for dim in spec.shape:
        numel *= dim
    return spec.sharded or (len(spec.shape) >= 1 and numel * spec.dtype.itemsize >= LAZY_BYTES)


def build_dataset(dataset_fn: Callable[..., Any], worker_index: int, num_workers: int) -> Any:
    """Calls ``dataset_fn()``, or ``dataset_fn(InputContext)`` when it takes an argument."""
    try:
        takes_context = bool(inspect.signature(dataset_fn).parameters)
    except (TypeError, ValueError):
        takes_context = False
    if takes_context:
        return dataset_fn(InputContext(num_workers, worker_index, 1))
    return dataset_fn()


class _RuntimeHolder:
    """The runtime of the coordinator session this worker process serves (None outside one).

    Set and cleared by the task server; read by nothing in unison (a scheduled function's
    references are resolved by the unpickler it is handed, :mod:`unison._ps.wire.worker_references`).
    For introspection, e.g. a test's scheduled function asking which worker it runs on."""

    def __init__(self) -> None:
        self.current: WorkerRuntime | None = None


RUNTIME = _RuntimeHolder()


class _GradientSync:
    """Attached to a worker's ps parameters; the optimizer hooks call it around ``step()``."""

    def __init__(self, runtime: WorkerRuntime):
        self._runtime = runtime

    def pre_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        self._runtime.push(optimizer)

    def post_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Nothing: the update happened on the ps tasks."""


class WorkerShardedParameter(nn.Parameter):
    """A worker's view of a ShardedVariable (or of a whole variable of ``LAZY_BYTES`` or more):
    holds no rows; an embedding lookup pulls the rows it needs, other uses the whole tensor."""

    _ps_spec: VariableSpec
    _ps_runtime: WorkerRuntime

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if is_metadata_function(func):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func is F.embedding:
            bound = _EMBEDDING.bind(*args, **kwargs)
            weight = bound.arguments["weight"]
            if isinstance(weight, WorkerShardedParameter):
                return weight._embedding(bound.arguments)
        if getattr(func, "__name__", "") == "__set__" or (getattr(func, "__name__", "").endswith("_") and args
                                                           and isinstance(args[0], WorkerShardedParameter)):
            raise TypeError(f"sharded variable {args[0]._ps_spec.name!r} cannot be written in place on a worker; "
                            f"update it with an optimizer created in the strategy's scope")
        args, kwargs = tree_map(lambda a: a._ps_runtime.materialize(a) if isinstance(a, WorkerShardedParameter) else a,
                                (args, kwargs))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def _embedding(self, arguments: dict) -> torch.Tensor:
        ids = arguments.pop("input")
        arguments.pop("weight")
        unique, inverse = distinct_ids(ids)
        rows = self._ps_runtime.lookup_rows(self, unique)
        pad = arguments.get("padding_idx")
        if pad is not None:
            pad = pad % self.shape[0]
            where = (unique == pad).nonzero()
            arguments["padding_idx"] = int(where[0, 0]) if where.numel() else None
        with torch._C.DisableTorchFunctionSubclass():
            return F.embedding(inverse, rows, **arguments)

    def __reduce_ex__(self, protocol: Any) -> tuple:
        return reference(WorkerReference.VARIABLE, self._ps_spec)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"WorkerShardedParameter({self._ps_spec.name!r}, shape={tuple(self.shape)})"


class WorkerRuntime:
    """Caches a worker's ps parameters and moves their values and gradients.

    Args:
        client: connections to the ps tasks.
        worker_index: this worker's index (for per-worker values).
    """

    def __init__(self, client: PSClient, worker_index: int):
        install_step_hooks()  # optimizer.step() must find the gradient sync
        self.client = client
        self.worker_index = worker_index
        self._cache: dict[str, nn.Parameter] = {}
        self._spec_of = WeakIdKeyDictionary()  # each cached parameter -> its VariableSpec (no attribute on the tensor)
        self._touched: dict[str, nn.Parameter] = {}
        self._rows: list[tuple[WorkerShardedParameter, torch.Tensor | None, torch.Tensor]] = []
        self._pulled: dict[str, torch.Tensor] = {}  # non-trainable values as pulled, to find the changes
        self._sync = _GradientSync(self)
        self.datasets: dict[int, Any] = {}
        self.iterators: dict[int, Any] = {}
        self._resolvers: dict[WorkerReference, Callable[[Any], Any]] = {
            WorkerReference.CLIENT: lambda _: lambda: self.client,
            WorkerReference.VARIABLE: self.variable,
            WorkerReference.PER_WORKER: lambda values: values[self.worker_index],
            WorkerReference.ITERATOR: self._iterator,
        }

    # -- what a scheduled function refers to -------------------------------------------------
    def resolve(self, kind: WorkerReference, payload: Any) -> Any:
        """This worker's object for a reference in a function the chief sent (see
        :mod:`unison._ps.wire.worker_references`): handed to the unpickler of that function."""
        return self._resolvers[kind](payload)

    def _iterator(self, payload: tuple[int, int]) -> Any:
        dataset_id, iterator_id = payload
        iterator = self.iterators.get(iterator_id)
        if iterator is None:
            iterator = self.iterators[iterator_id] = iter(self.datasets[dataset_id])
        return iterator

    # -- one function's life -------------------------------------------------------------
    def begin(self) -> None:
        """Forgets what the previous function touched."""
        for param in self._touched.values():
            param.grad = None
        self._touched.clear()
        self._rows.clear()
        self._pulled.clear()

    def variable(self, spec: VariableSpec) -> nn.Parameter:
        """This worker's parameter for ``spec`` (created on first use), noted as touched."""
        param: Any = self._cache.get(spec.key)
        if param is None:
            if _is_lazy(spec):
                param = WorkerShardedParameter(torch.zeros((), dtype=spec.dtype).expand(spec.shape), spec.requires_grad)
                param._ps_runtime, param._ps_spec = self, spec
            else:
                param = nn.Parameter(self.client.new_tensor(spec.shape, spec.dtype), requires_grad=spec.requires_grad)
            self._spec_of[param] = spec
            attach(param, self._sync)
            self._cache[spec.key] = param
        if not isinstance(param, WorkerShardedParameter):
            self._touched[spec.key] = param
        return param

    def pull_touched(self) -> None:
        """Pulls every touched whole variable, one request per ps task."""
        by_ps: dict[int, list[tuple[str, torch.Tensor]]] = {}
        for param in self._touched.values():
            part = self._spec_of[param].parts[0]
            by_ps.setdefault(part.task, []).append((part.key, param.detach()))
        if by_ps:
            self.client.pull_into(by_ps)
        self._pulled = {key: param.detach().clone() for key, param in self._touched.items()
                        if not self._spec_of[param].requires_grad}

    def push_changes(self) -> None:
        """Sends what the function changed in non-trainable whole variables: differences to
        add (a bool variable: its value to assign), one request per ps task each."""
        adds: tuple[list[tuple[int, str]], list[torch.Tensor]] = ([], [])
        assigns: tuple[list[tuple[int, str]], list[torch.Tensor]] = ([], [])
        for key, before in self._pulled.items():
            now = self._touched[key].detach()
            if torch.equal(now, before):
                continue
            part = self._spec_of[self._touched[key]].parts[0]
            placed, values = assigns if now.dtype == torch.bool else adds
            placed.append((part.task, part.key))
            values.append(now.clone() if now.dtype == torch.bool else now - before)
        for kind, (placed, values) in ((wire.Add, adds), (wire.Assign, assigns)):
            if placed:
                self.client.write(kind, placed, values)

    def end(self) -> None:
        """Drops the rows pulled for the function that just ran."""
        self._rows.clear()
        self._pulled.clear()

    # -- sharded variables ----------------------------------------------------------------
    def lookup_rows(self, param: WorkerShardedParameter, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (unique, global) of a sharded variable, pulled with one request per ps task."""
        spec = param._ps_spec
        starts = torch.tensor(spec.row_starts())
        shard_of = torch.bucketize(ids, starts[1:], right=True)
        by_ps: dict[int, list[tuple[str, torch.Tensor]]] = {}
        masks = []
        for index, part in enumerate(spec.parts):
            mask = shard_of == index
            if bool(mask.any()):
                by_ps.setdefault(part.task, []).append((part.key, (ids[mask] - starts[index]).contiguous()))
                masks.append((part.task, mask))
        replies = self.client.pull_rows(by_ps) if by_ps else {}
        rows = torch.empty((ids.numel(),) + spec.shape[1:], dtype=spec.dtype)
        taken: dict[int, int] = {}
        for task, mask in masks:
            position = taken.get(task, 0)
            rows[mask] = replies[task][position]
            taken[task] = position + 1
        rows.requires_grad_(param.requires_grad)
        self._rows.append((param, ids, rows))
        return rows

    def materialize(self, param: WorkerShardedParameter) -> torch.Tensor:
        """The whole sharded variable (for uses other than an embedding lookup)."""
        spec = param._ps_spec
        full = torch.cat(self.client.read([(p.task, p.key) for p in spec.parts]), dim=0)
        full.requires_grad_(param.requires_grad)
        self._rows.append((param, None, full))
        return full

    # -- gradients --------------------------------------------------------------------
    def push(self, optimizer: torch.optim.Optimizer) -> None:
        """Sends the gradients of ``optimizer``'s ps parameters, one request per ps task."""
        cls = type(optimizer)
        by_ps: dict[int, list[tuple[str, Any, torch.Tensor, type, dict]]] = {}
        for group in optimizer.param_groups:
            hyper = {k: v for k, v in group.items() if k != "params"}
            for param in group["params"]:
                spec = self._spec_of.get(param)
                if spec is None:
                    continue
                if isinstance(param, WorkerShardedParameter):
                    for owner, ids, local in self._rows:
                        if owner is param and local.grad is not None:
                            self._add_sharded(by_ps, spec, ids, local.grad, cls, hyper)
                            local.grad = None
                    continue
                grad = param.grad
                if grad is None:
                    continue
                part = spec.parts[0]
                if grad.is_sparse:
                    grad = grad.coalesce()
                    entry = (part.key, grad.indices()[0].contiguous(), grad.values().contiguous(), cls, hyper)
                else:
                    entry = (part.key, None, grad, cls, hyper)
                by_ps.setdefault(part.task, []).append(entry)
                param.grad = None
        if by_ps:
            self.client.push(by_ps)

    @staticmethod
    def _add_sharded(by_ps: dict, spec: VariableSpec, ids: torch.Tensor | None, grad: torch.Tensor,
                     cls: type, hyper: dict) -> None:
        if grad.is_sparse:
            grad = grad.coalesce().to_dense()
        starts = spec.row_starts()
        if ids is None:  # the whole tensor was used: one dense gradient per shard
            for part, piece in zip(spec.parts, torch.split(grad, [p.rows for p in spec.parts], dim=0)):
                by_ps.setdefault(part.task, []).append((part.key, None, piece.contiguous(), cls, hyper))
            return
        shard_of = torch.bucketize(ids, torch.tensor(starts[1:]), right=True)
        for index, part in enumerate(spec.parts):
            mask = shard_of == index
            if bool(mask.any()):
                local_ids = (ids[mask] - starts[index]).contiguous()
                by_ps.setdefault(part.task, []).append((part.key, local_ids, grad[mask].contiguous(), cls, hyper))
