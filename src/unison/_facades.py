"""Lazy public facades over private modules: ``lazy_loader.attach_stub`` for absolute imports.

``lazy_loader.attach_stub`` reads a package's ``__init__.pyi`` but accepts only imports
from the package's own submodules (``from .x import y``). A public facade such as
``unison.coordinator`` re-exports names of a private package (``unison._coordinator``),
so its stub imports them by absolute path; :func:`attach_stub` reads those, and loads
each name on first use, so that importing the facade imports nothing else (no torch).
Type checkers read the same stub. ``EAGER_IMPORT=1`` loads every name at once, as
lazy_loader's switch does.
"""

from __future__ import annotations

import ast
import importlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["attach_stub"]


def _read_stub(path: Path) -> tuple[dict[str, str], list[str] | None]:
    """The names the stub imports (name -> module) and its ``__all__``, if it declares one."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    sources: dict[str, str] = {}
    declared = None
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            if node.level or not node.module or any(alias.name == "*" for alias in node.names):
                raise ValueError(f"{path}: only absolute `from module import name` statements are read")
            sources.update({alias.asname or alias.name: f"{node.module}:{alias.name}" for alias in node.names})
        elif isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
            declared = list(ast.literal_eval(node.value))
    return sources, declared


def attach_stub(package_name: str, filename: str) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """``__getattr__``, ``__dir__`` and ``__all__`` for a module whose names its ``.pyi`` stub imports.

    Args:
        package_name: the module's ``__name__``.
        filename: the module's ``__file__``; the stub is the file beside it with the ``.pyi`` suffix.

    Returns:
        The module's ``__getattr__`` (loads a name on first use and keeps it in the module),
        ``__dir__`` and ``__all__`` (the stub's ``__all__``, else every name it imports).
    """
    sources, declared = _read_stub(Path(filename).with_suffix(".pyi"))
    names = declared if declared is not None else sorted(sources)

    def __getattr__(name: str) -> Any:
        if name not in sources:
            raise AttributeError(f"module {package_name!r} has no attribute {name!r}")
        module, _, attribute = sources[name].partition(":")
        value = getattr(importlib.import_module(module), attribute)
        vars(sys.modules[package_name])[name] = value
        return value

    def __dir__() -> list[str]:
        return list(names)

    if os.environ.get("EAGER_IMPORT"):
        for name in sources:
            __getattr__(name)
    return __getattr__, __dir__, list(names)
