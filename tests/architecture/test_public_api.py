"""The public face, by PyTorch's rule (``test/test_public_bindings.py``).

Every module of the package is walked (``pkgutil.walk_packages``, as PyTorch walks
``torch``). A module whose dotted path has no segment that starts with ``_`` is public;
its names are its ``__all__``. Internals live under underscored paths (``unison._ps``,
``unison._collectives``, ...), which this test leaves alone. Rules for each public module:

- it declares ``__all__`` (what it offers, once each; no name with a leading underscore);
- every listed name can be imported from it (``from unison.placement import X``);
- every listed name is documented: classes, functions and modules by their own
  docstring, constants by a ``#:`` comment above or a string below their assignment;
- a class or function listed is found at ``__module__`` + ``__qualname__`` (reprs,
  pickles and API docs point at a real place);
- an object has one public home: no two public modules list the same class or function
  (one module may, under TF's two names: ``CollectiveAllReduceStrategy``).

And the face stays small: at most ``MAX_PUBLIC_NAMES`` names over all public modules,
and the public modules are exactly ``PUBLIC_MODULES`` (a new one is a decision, made
here). The paths and names that left the face in 0.2 are deprecated aliases, checked in
``test_deprecated_aliases.py``; ``test_public_names_and_stubs.py`` checks the names
tf.distribute users look for, the lazy packages' stubs and the import cost.
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

#: The public modules, by PyTorch's rule. A module added here is a public promise: keep it small.
PUBLIC_MODULES = {
    "unison", "unison.coordinator", "unison.embeddings", "unison.errors", "unison.launch", "unison.partitioners",
    "unison.optim", "unison.placement", "unison.progress", "unison.tensorpack",
}

#: At most this many public names (the sum of the public modules' ``__all__``; 762 before 0.2).
MAX_PUBLIC_NAMES = 200

#: Modules the rules below check besides those the walk finds (the self-tests add a fake one).
EXTRA_MODULES: tuple[str, ...] = ()


def _is_private(dotted: str) -> bool:
    return any(part.startswith("_") for part in dotted.split("."))


def _public_modules() -> dict[str, types.ModuleType]:
    """Every module of unison whose path is public, by walking the package as PyTorch walks torch."""
    names = ["unison", *(info.name for info in pkgutil.walk_packages(unison.__path__, "unison."))]
    return {name: importlib.import_module(name) for name in [*names, *EXTRA_MODULES] if not _is_private(name)}


def _exports() -> list[tuple[str, str, Any]]:
    """(module path, name, object) for every name a public module lists in ``__all__``."""
    return [(path, name, getattr(module, name)) for path, module in _public_modules().items()
            for name in getattr(module, "__all__", ()) if hasattr(module, name)]


def _own_doc(obj: Any) -> str:
    """The docstring ``obj`` itself carries (a class's, not one inherited from a base)."""
    doc = vars(obj).get("__doc__") if inspect.isclass(obj) else obj.__doc__
    return inspect.cleandoc(doc) if isinstance(doc, str) else ""


def _documented_constant(name: str, value: Any) -> bool:
    """Whether a unison module assigns ``name`` (to ``value``) with a ``#:`` comment above or a string below."""
    for module in [m for key, m in list(sys.modules.items()) if key == "unison" or key.startswith("unison.")]:
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


def test_the_public_modules_are_exactly_the_promised_ones():
    """Guards the walk too: a broken walk would make every rule below pass on nothing."""
    found = set(_public_modules())
    assert found == PUBLIC_MODULES, (f"public modules (no '_' in their path) not promised: "
                                     f"{sorted(found - PUBLIC_MODULES)} (move them under an underscored path, or "
                                     f"add them to PUBLIC_MODULES); promised but missing: "
                                     f"{sorted(PUBLIC_MODULES - found)}")


def test_the_public_face_has_at_most_200_names():
    counts = {path: len(getattr(module, "__all__", ())) for path, module in _public_modules().items()}
    total = sum(counts.values())
    print(f"\npublic names by PyTorch's rule: {total} in {len(counts)} modules: {counts}")
    assert total <= MAX_PUBLIC_NAMES, f"{total} public names (at most {MAX_PUBLIC_NAMES}): {counts}"


def test_every_public_module_declares_all_once_and_each_name_imports():
    problems = []
    for path, module in _public_modules().items():
        names = getattr(module, "__all__", None)
        if not isinstance(names, (list, tuple)):
            problems.append(f"{path} has no __all__ (a list of what it offers)")
            continue
        duplicates = sorted({n for n in names if list(names).count(n) > 1})
        if duplicates:
            problems.append(f"{path}.__all__ lists {duplicates} more than once")
        private = [n for n in names if n.startswith("_")]
        if private:
            problems.append(f"{path}.__all__ lists private names {private}")
        for name in names:
            try:
                exec(f"from {path} import {name}", {})
            except ImportError as error:
                problems.append(f"{path}.__all__ lists {name!r}, which does not import: {error}")
    assert not problems, "\n".join(problems)


def test_every_public_name_is_documented():
    missing = []
    for path, name, obj in _exports():
        if isinstance(obj, types.ModuleType) or inspect.isclass(obj) or inspect.isroutine(obj):
            doc = _own_doc(obj)
            if len(doc.splitlines()[0] if doc else "") <= 10:
                missing.append(f"{path}.{name}: no docstring of its own, or a summary of 10 characters or less")
        elif not _documented_constant(name, obj):
            missing.append(f"{path}.{name}: constant without a '#:' comment above or a string below its assignment")
    assert not missing, "\n".join(missing)


def test_public_classes_and_functions_are_where_their_module_says():
    wrong = []
    for path, name, obj in _exports():
        if not (inspect.isclass(obj) or inspect.isroutine(obj)) or not obj.__module__.startswith("unison"):
            continue
        found: Any = importlib.import_module(obj.__module__)
        for part in obj.__qualname__.split("."):
            found = getattr(found, part, None)
        if found is not obj:
            wrong.append(f"{path}.{name}: {obj.__module__}.{obj.__qualname__} is not this object")
    assert not wrong, "\n".join(wrong)


def test_each_public_class_and_function_has_one_public_home():
    """One module per object; one module may list it twice under TF's two names (``CollectiveAllReduceStrategy``)."""
    homes: dict[int, list[str]] = {}
    for path, name, obj in _exports():
        if inspect.isclass(obj) or inspect.isroutine(obj):
            homes.setdefault(id(obj), []).append(f"{path}.{name}")
    duplicates = sorted(paths for paths in homes.values() if len({p.rpartition(".")[0] for p in paths}) > 1)
    assert not duplicates, f"listed by more than one public module (keep one, alias the other): {duplicates}"


def _fake_module(broken: str) -> types.ModuleType:
    fake = types.ModuleType("unison.fake_public", "A public module made for this test.")
    fake.__file__ = __file__

    def helper() -> None:
        pass

    helper.__module__, helper.__qualname__ = fake.__name__, "helper"
    fake.helper, fake.LIMIT, fake._helper = helper, object(), helper
    fake.__all__ = {"private name": ["_helper"], "undocumented function": ["helper"],
                    "undocumented constant": ["LIMIT"], "no __all__": None, "missing name": ["absent"],
                    "second home": ["select_cross_device_ops"]}[broken]
    if broken == "second home":
        fake.select_cross_device_ops = unison.select_cross_device_ops
    if fake.__all__ is None:
        del fake.__all__
    return fake


@pytest.mark.parametrize("broken", ["private name", "undocumented function", "undocumented constant", "no __all__",
                                    "missing name", "second home", "not promised"])
def test_the_rules_catch_a_broken_public_module(broken, monkeypatch):
    """Each rule fails on a public module that breaks it (the rules above are not vacuous)."""
    fake = _fake_module("undocumented function" if broken == "not promised" else broken)
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    monkeypatch.setattr(sys.modules[__name__], "EXTRA_MODULES", (fake.__name__,))
    rule = {"private name": test_every_public_module_declares_all_once_and_each_name_imports,
            "undocumented function": test_every_public_name_is_documented,
            "undocumented constant": test_every_public_name_is_documented,
            "no __all__": test_every_public_module_declares_all_once_and_each_name_imports,
            "missing name": test_every_public_module_declares_all_once_and_each_name_imports,
            "second home": test_each_public_class_and_function_has_one_public_home,
            "not promised": test_the_public_modules_are_exactly_the_promised_ones}[broken]
    with pytest.raises(AssertionError, match="unison.fake_public"):
        rule()


def test_the_name_count_catches_a_face_that_grows(monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "MAX_PUBLIC_NAMES", 10)
    with pytest.raises(AssertionError, match="public names"):
        test_the_public_face_has_at_most_200_names()
