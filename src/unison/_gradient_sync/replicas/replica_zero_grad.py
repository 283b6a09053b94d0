"""``optimizer.zero_grad()`` inside a replica without a dispatch per parameter.

PyTorch's ``zero_grad`` reads and sets ``p.grad`` on every parameter. On a distributed
variable (a tensor subclass) each of those goes through ``__torch_function__`` to reach
the replica's own component: two dispatches per parameter per replica per step, a
visible share of a step of a many-parameter model (``benchmarks/RESULTS.md``, 'Replica
zero_grad without dispatch'). Once an optimizer of the strategy has stepped, its instance gets a
``zero_grad`` that, inside a replica and with ``set_to_none=True`` (the default), sets
the replica's components' gradients to None directly: what the dispatched version
does. In cross-replica context, ``set_to_none=False`` zeroes every replica's gradient
in place (the class's ``zero_grad`` reaches component 0's only, through the plain
gradient ``p.grad`` reads). Everything else calls the class's ``zero_grad`` unchanged.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable

import torch

from unison._gradient_sync.grad_access import clear_grads
from unison._interpose.optimizer_hooks import replica_zero_grad
from unison._values.variables import DistributedVariable

__all__ = ["install_replica_zero_grad"]

_MARK = "_unison_replica_zero_grad"


def install_replica_zero_grad(optimizer: torch.optim.Optimizer,
                              replica_of: Callable[[], int | None]) -> None:
    """Gives ``optimizer`` (once) a ``zero_grad`` taking the fast path inside a replica.

    Args:
        optimizer: the user's optimizer over a strategy's variables.
        replica_of: the local replica id of the calling thread's replica of that
            strategy, or None outside its replicas.
    """
    if getattr(optimizer.__dict__.get("zero_grad"), _MARK, False):
        return
    owner = weakref.ref(optimizer)  # no cycle through the instance's own attribute
    components: dict[int, tuple[list, list]] = {}  # replica id -> (the parameters, their components there)
    original = type(optimizer).zero_grad

    def zero_grad(set_to_none: bool = True) -> None:
        opt = owner()
        if opt is None:
            return
        replica_id = replica_of()
        if replica_id is None or not set_to_none:
            original(opt, set_to_none)
            if replica_id is None and not set_to_none:
                _zero_other_replicas_grads(opt)
            return
        params = [param for group in opt.param_groups for param in group["params"]]
        known = components.get(replica_id)
        if known is None or len(known[0]) != len(params) or not all(map(operator.is_, known[0], params)):
            # a variable's components are made with it and never replaced: kept until the parameters change
            known = components[replica_id] = (params, [
                param.component(replica_id) if isinstance(param, DistributedVariable) else param for param in params])
        with torch._C.DisableTorchFunctionSubclass():
            clear_grads(known[1])

    zero_grad.__doc__ = original.__doc__
    setattr(zero_grad, _MARK, True)
    replica_zero_grad(optimizer, zero_grad=zero_grad)  # the instance's own (_interpose/optimizer_hooks.py)


def _zero_other_replicas_grads(optimizer: torch.optim.Optimizer) -> None:
    """Zeroes, in place, the gradients of replicas 1.. (what ``zero_grad(set_to_none=False)``
    does to component 0's), as the class's ``zero_grad`` does: detached from any graph first."""
    with torch.no_grad():
        for group in optimizer.param_groups:
            for param in group["params"]:
                if not isinstance(param, DistributedVariable):
                    continue
                for replica_id in range(1, 1 + len(param._others)):
                    grad = param.component_grad(replica_id)
                    if grad is not None:
                        if grad.grad_fn is not None:
                            grad.detach_()
                        else:
                            grad.requires_grad_(False)
                        grad.zero_()
