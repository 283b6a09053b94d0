"""The private parts of torch that unison's synchronisers read, named once.

torch has no public way to ask whether anything outside Python still holds a storage or
a tensor (autograd's saved tensors, a pending collective), which the buffer pool and the
gradient slots need before they reuse memory; to run a callback when the current
backward pass ends (DDP uses the same engine callback); to tell one backward pass from
the next; or whether its NCCL bindings are built. Those reads live here, so a torch
release that moves one breaks one module. Not here: the tensor-subclass idioms the
distributed values use below this layer (``torch._C.TensorBase``'s descriptors,
``DisableTorchFunctionSubclass``, ``Tensor._make_subclass``, as torch's own subclass
documentation writes them), ``torch._foreach_*`` (torch's optimizers' kernels),
``torch.utils._pytree``, and Dynamo's DDP optimizer, read where the compiled step is
split (``_strategies/extended.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._utils import _unflatten_dense_tensors

__all__ = ["GRAD_DESCRIPTOR", "TENSOR_USE_COUNT", "current_graph_task_id", "has_nccl_all_reduce",
           "queue_end_of_backward", "storage_use_count", "torch_function_modes", "unflatten_dense_tensors"]

GRAD_DESCRIPTOR: Any = torch._C.TensorBase.grad
"""The C descriptor behind ``Tensor.grad``: its ``__get__``/``__set__`` read and write a
gradient without ``__torch_function__`` (mapped over every gradient of a step)."""

torch_function_modes: Callable[[], int] = torch._C._len_torch_function_stack
"""How many torch-function modes this thread has pushed (the C function itself: read on
every one-device step)."""

current_graph_task_id: Callable[[], int] = torch._C._current_graph_task_id
"""An id of the backward pass running on this thread (-1 outside one)."""

unflatten_dense_tensors: Callable[..., Any] = _unflatten_dense_tensors
"""Views of a flat buffer shaped like the given tensors, one after another."""


def queue_end_of_backward(callback: Callable[[], None]) -> None:
    """Runs ``callback`` when the backward pass running now has finished (as DDP does)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)  # type: ignore[attr-defined]

_storage_use_count: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)

TENSOR_USE_COUNT: Callable[[torch.Tensor], int] | None = getattr(torch._C.TensorBase, "_use_count", None)
"""How many C++ holders a tensor itself has (autograd keeps one for a gradient it will
write again), or None when this torch does not say. The C function itself, not a wrapper:
the gradient slots map it over every gradient each step."""


def storage_use_count(tensor: torch.Tensor) -> int | None:
    """How many holders ``tensor``'s storage has (tensors and views on it, saved
    tensors), or None when this torch does not say (then nothing may be reused)."""
    if _storage_use_count is None:
        return None
    return _storage_use_count(tensor.untyped_storage()._cdata)


def has_nccl_all_reduce() -> bool:
    """Whether this torch was built with its in-process NCCL all-reduce (``torch.cuda.nccl``)."""
    return hasattr(torch._C, "_nccl_all_reduce")
