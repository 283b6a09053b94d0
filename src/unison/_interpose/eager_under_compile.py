"""``torch.compiler.disable`` that leaves Dynamo unimported until something compiles.

``torch.compiler.disable`` imports ``torch._dynamo`` where it decorates: 2 s of the 6 s a
2-core VM took to import torch and the table modules, paid by every worker and ps task of
a recommendation job, compiled or not. The function gets the two marks Dynamo acts on
instead, set without importing it: the attribute by which a trace breaks the graph at a
call instead of inlining it (the one ``torch.compiler.disable`` sets on its wrapper), and a
frame strategy in torch's C frame-evaluation hooks (which load with torch) by which
Dynamo skips the function's frames and every frame they call, as it skips those of the
wrapper's call. Compiled programs see the same graph breaks, frames and graphs
(``tests/embeddings/test_eager_under_compile.py``). Where a torch lacks the hooks, the
plain ``torch.compiler.disable`` is used, Dynamo's import included.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["eager_under_compile"]

_F = TypeVar("_F", bound=Callable[..., Any])

_skip_frames: Callable[[types.CodeType], None] | None
try:
    from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy

    def _skip_frames(code: types.CodeType) -> None:
        """Dynamo neither traces a frame of ``code`` nor any frame it calls."""
        set_code_exec_strategy(code, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP))
except ImportError:  # pragma: no cover - another torch: decorate as torch does
    _skip_frames = None


def eager_under_compile(fn: _F) -> _F:
    """Runs ``fn`` eagerly under ``torch.compile`` (a graph break), as ``torch.compiler.disable``.

    Returns ``fn`` itself, marked: no wrapper, so no call costs anything outside a compile.
    """
    if _skip_frames is None:  # pragma: no cover
        return torch.compiler.disable(fn)
    fn._torchdynamo_disable = True  # type: ignore[attr-defined]  # a trace breaks here, never inlines
    _skip_frames(fn.__code__)  # type: ignore[attr-defined]  # where the break runs it: no frame traced
    return fn
