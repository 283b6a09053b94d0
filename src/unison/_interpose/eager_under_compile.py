"""Run a function eagerly under ``torch.compile``, without importing Dynamo until it is in use.

A table's forward picks rows by the ids' values (a numpy index, the table's hooks), which
Dynamo cannot trace: under ``torch.compile`` it must run eagerly (``torch.compiler.disable``,
a graph break). But ``torch.compiler.disable`` imports ``torch._dynamo`` when it decorates:
every process that imported the tables paid for it, also one that never compiles nor
builds a torch optimizer (whose constructor imports Dynamo as well). On the 2-core VM,
``import unison`` with ``unison.embeddings.ServingEmbedding`` and ``DynamicEmbedding`` took a
serving process 4.3-5.3 s, and 2.4-2.8 s without Dynamo (``benchmarks/RESULTS.md``).

:func:`eager_under_compile` marks the function instead: it calls it as it is while
``torch._dynamo`` is not imported (nothing can be compiling then: ``torch.compile`` imports
it), and through ``torch.compiler.disable(fn)``, made once, from then on.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["eager_under_compile"]

_Fn = TypeVar("_Fn", bound=Callable[..., Any])


def eager_under_compile(fn: _Fn) -> _Fn:
    """``fn``, run eagerly under ``torch.compile`` (as ``torch.compiler.disable(fn)``), imported
    without Dynamo: see the module's docstring."""
    # torch.compiler.disable(fn), once Dynamo is loaded: a list, not a nonlocal, because Dynamo traces
    # this wrapper when a compiled caller reaches it and read a rebound closure cell as still None
    disabled: list[Callable[..., Any]] = []

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if "torch._dynamo" not in sys.modules:
            return fn(*args, **kwargs)
        if not disabled:
            import torch

            disabled.append(torch.compiler.disable(fn))
        return disabled[0](*args, **kwargs)

    return run  # type: ignore[return-value]
