"""The public face, in the manner of PyTorch's ``test_public_bindings.py``.

A public namespace is ``unison``, ``unison.coordinator`` and, recursively, every module a
public namespace lists in its ``__all__`` (``unison._cluster``, ``unison._cluster.env``, ...),
each named by the dotted path a user writes (``unison.partitioners``, though that module
is ``unison._ps.remote_variables.shard_partitioners``). Rules:

- a leading underscore means private: no exported path has a segment that starts with
  one, and no ``__all__`` lists such a name. The rule reads the *exported* path, so a
  class may live in any module and be re-exported under a public name;
- every exported name resolves and is documented (classes, functions and modules by
  their own docstring, constants by a ``#:`` comment above or a string below their
  assignment);
- a class or function exported can be found at ``__module__`` + ``__qualname__``
  (reprs, pickles and API docs point at a real place);
- every module whose path is public (no segment with a leading underscore) declares
  ``__all__``: what it offers is listed, anything else is its own business.

``tests/architecture/test_public_names_and_stubs.py`` checks the names tf.distribute users
look for, the lazy packages' stubs and the import cost.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import sys
import types
from typing import Any

import pytest

import unison

ROOTS = ("unison", "unison._coordinator")


def _namespaces() -> dict[str, types.ModuleType]:
    """Every public namespace by its exported dotted path, roots first."""
    found: dict[str, types.ModuleType] = {}
    todo = list(ROOTS)
    while todo:
        path = todo.pop(0)
        if path in found:
            continue
        module = importlib.import_module(path)
        found[path] = module
        todo += [f"{path}.{name}" for name in getattr(module, "__all__", ())
                 if isinstance(getattr(module, name, None), types.ModuleType)]
    return found


def _exports() -> list[tuple[str, str, Any]]:
    """(namespace path, name, object) for every name a public namespace exports."""
    return [(path, name, getattr(module, name)) for path, module in _namespaces().items() for name in module.__all__]


def _is_private(dotted: str) -> bool:
    return any(part.startswith("_") for part in dotted.split("."))


def _own_doc(obj: Any) -> str:
    """The docstring ``obj`` itself carries (a class's, not one inherited from a base)."""
    doc = vars(obj).get("__doc__") if inspect.isclass(obj) else obj.__doc__
    return inspect.cleandoc(doc) if isinstance(doc, str) else ""


def _documented_constant(name: str, value: Any) -> bool:
    """Whether a unison module assigns ``name`` (to ``value``) with a ``#:`` comment above or a string below."""
    for module in [m for key, m in sys.modules.items() if key == "unison" or key.startswith("unison.")]:
        if getattr(module, name, None) is not value or not getattr(module, "__file__", None):
            continue
        source = inspect.getsource(module)
        lines = source.splitlines()
        body = ast.parse(source).body
        for k, node in enumerate(body):
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, ast.AnnAssign) else [])
            if not any(isinstance(t, ast.Name) and t.id == name for t in targets):
                continue
            above = lines[node.lineno - 2].strip() if node.lineno >= 2 else ""
            below = body[k + 1] if k + 1 < len(body) else None
            if above.startswith("#:") or (isinstance(below, ast.Expr) and isinstance(below.value, ast.Constant)
                                          and isinstance(below.value.value, str) and below.value.value.strip()):
                return True
    return False


def test_the_namespaces_found_include_those_the_readme_documents():
    """Guards the walk itself: a broken walk would make every rule below pass on nothing."""
    assert {"unison", "unison._checkpoint", "unison._cluster", "unison._cluster.multi_worker_util", "unison._collectives",
            "unison.coordinator", "unison.errors", "unison.partitioners", "unison.placement"} <= set(_namespaces())


def test_every_namespace_lists_its_names_once_and_each_resolves():
    problems = []
    for path, module in _namespaces().items():
        names = getattr(module, "__all__", None)
        if names is None:
            problems.append(f"{path} has no __all__")
            continue
        duplicates = sorted({n for n in names if list(names).count(n) > 1})
        if duplicates:
            problems.append(f"{path}.__all__ lists {duplicates} more than once")
        for name in names:
            if not hasattr(module, name):
                problems.append(f"{path}.__all__ lists {name!r}, which {path} does not have")
    assert not problems, "\n".join(problems)


def test_no_exported_path_has_a_private_segment():
    """The underscore rule: ``unison._cluster.env`` is fine, ``unison._state.X`` or ``unison._cluster._x`` is not.

    The exported path is what a user writes; a class defined in a private module and
    re-exported under a public name passes."""
    private = [f"{path}.{name}" for path, name, _ in _exports() if _is_private(f"{path}.{name}")]
    assert not private, f"public paths with a segment that starts with '_': {private}"


def test_every_exported_name_is_documented():
    missing = []
    for path, name, obj in _exports():
        if isinstance(obj, types.ModuleType) or inspect.isclass(obj) or inspect.isroutine(obj):
            doc = _own_doc(obj)
            if len(doc.splitlines()[0] if doc else "") <= 10:
                missing.append(f"{path}.{name}: no docstring of its own, or a summary of 10 characters or less")
        elif not _documented_constant(name, obj):
            missing.append(f"{path}.{name}: constant without a '#:' comment above or a string below its assignment")
    assert not missing, "\n".join(missing)


def test_exported_classes_and_functions_are_where_their_module_says():
    wrong = []
    for path, name, obj in _exports():
        if not (inspect.isclass(obj) or inspect.isroutine(obj)) or not obj.__module__.startswith("unison"):
            continue
        found: Any = sys.modules.get(obj.__module__)
        for part in obj.__qualname__.split("."):
            found = getattr(found, part, None)
        if found is not obj:
            wrong.append(f"{path}.{name}: {obj.__module__}.{obj.__qualname__} is not this object")
    assert not wrong, "\n".join(wrong)


def test_every_public_module_declares_all():
    undeclared = []
    for info in pkgutil.walk_packages(unison.__path__, "unison."):
        if _is_private(info.name) or info.name.endswith("__main__"):
            continue
        if not isinstance(getattr(importlib.import_module(info.name), "__all__", None), (list, tuple)):
            undeclared.append(info.name)
    assert not undeclared, f"public modules without __all__ (a list of what they offer, or []): {undeclared}"


@pytest.mark.parametrize("broken", ["private name", "undocumented function", "undocumented constant", "no __all__"])
def test_the_rules_catch_a_broken_namespace(broken, monkeypatch):
    """Each rule fails on a namespace that breaks it (the rules above are not vacuous)."""
    fake = types.ModuleType("unison.fake_public", "A public namespace made for this test.")
    fake.__file__ = __file__

    def helper() -> None:
        pass

    helper.__module__, helper.__qualname__ = fake.__name__, "helper"
    fake.helper, fake.LIMIT = helper, object()
    fake.__all__ = {"private name": ["_helper"], "undocumented function": ["helper"],
                    "undocumented constant": ["LIMIT"], "no __all__": None}[broken]
    if fake.__all__ is None:
        del fake.__all__
    fake._helper = helper
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    monkeypatch.setattr(sys.modules[__name__], "ROOTS", ROOTS + (fake.__name__,))
    rule = {"private name": test_no_exported_path_has_a_private_segment,
            "undocumented function": test_every_exported_name_is_documented,
            "undocumented constant": test_every_exported_name_is_documented,
            "no __all__": test_every_namespace_lists_its_names_once_and_each_resolves}[broken]
    with pytest.raises(AssertionError, match="unison.fake_public"):
        rule()
