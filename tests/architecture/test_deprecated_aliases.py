"""The paths and names that left the public face in 0.2 still work until 0.3, with a warning.

Each entry of ``unison._deprecation`` is checked in a fresh interpreter (a module warns
when it is first imported): the old path gives the very object at the new one (so pickles
by the old path load, and patches through it reach the code), a ``DeprecationWarning``
names the replacement and points at the user's line, and ``CHANGELOG.md`` lists it.
"""

from __future__ import annotations

import importlib
import json
import pickle
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

import unison
from tests.architecture.test_public_api import PUBLIC_MODULES
from unison._deprecation import MOVED_MODULES, MOVED_NAMES, moved_module

pytestmark = pytest.mark.timeout(120)

CHANGELOG = Path(__file__).resolve().parents[2] / "CHANGELOG.md"

_PROBE = textwrap.dedent('''
    import importlib, json, pkgutil, sys, warnings
    import unison
    from unison._deprecation import MOVED_MODULES, MOVED_NAMES

    def caught(action):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            value = action()
        return value, [(str(w.message), w.category.__name__, w.filename) for w in seen]

    report = {"modules": {}, "names": {}}
    for old, moved in MOVED_MODULES.items():
        new = importlib.import_module(moved.target)
        # one submodule below it too, reached by its old path first
        subs = [info.name for info in pkgutil.iter_modules(new.__path__)] if hasattr(new, "__path__") else []
        for path, target in [(old, moved.target)] + [(f"{old}.{s}", f"{moved.target}.{s}") for s in subs[:1]]:
            value, seen = caught(lambda: importlib.import_module(path))
            report["modules"][path] = {"same": value is importlib.import_module(target), "warnings": seen,
                                       "facade": value.__name__ == path, "spec": value.__spec__.name}
    for namespace, names in MOVED_NAMES.items():
        module = importlib.import_module(namespace)
        for name, moved in names.items():
            value, seen = caught(lambda: getattr(module, name))
            where, _, attribute = moved.target.partition(":")
            report["names"][f"{namespace}.{name}"] = {
                "same": value is getattr(importlib.import_module(where), attribute), "warnings": seen}
    print(json.dumps(report))
''')


@pytest.fixture(scope="module")
def report() -> dict:
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def _deprecations(seen: list, name: str) -> list[str]:
    return [message for message, category, _ in seen if category == "DeprecationWarning" and name in message]


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_an_old_module_path_is_the_module_at_its_new_one_with_a_warning(report, old):
    checked = {path: entry for path, entry in report["modules"].items() if path == old or path.startswith(f"{old}.")}
    package = hasattr(importlib.import_module(MOVED_MODULES[old].target), "__path__")
    assert old in checked and len(checked) == (2 if package else 1)  # and one module below a package
    for path, entry in checked.items():
        if entry["facade"]:  # a public module is back at the old path: it is itself, with no warning
            assert path == old and old in PUBLIC_MODULES and not entry["warnings"], entry
            continue
        assert entry["same"], f"{path} is not the module at {moved_module(path)[0]}"
        assert entry["spec"] == moved_module(path)[0], "the alias left the module its own __spec__"
        messages = _deprecations(entry["warnings"], f"{path} is deprecated")
        assert len(messages) == 1, entry["warnings"]
        instead = MOVED_MODULES[old].instead
        assert "removed in unison 0.3" in messages[0] and moved_module(path)[0] in messages[0]
        assert (f"use {instead} instead" if instead else "no public replacement") in messages[0]


@pytest.mark.parametrize("dotted", sorted(f"{ns}.{name}" for ns, names in MOVED_NAMES.items() for name in names))
def test_a_name_that_left_a_public_namespace_is_the_same_object_with_a_warning(report, dotted):
    entry = report["names"][dotted]
    namespace, _, name = dotted.rpartition(".")
    instead = MOVED_NAMES[namespace][name].instead
    assert entry["same"]
    messages = _deprecations(entry["warnings"], f"{dotted} is deprecated")
    assert len(messages) == 1, entry["warnings"]
    assert (f"use {instead} instead" if instead else "no public replacement") in messages[0]


def test_every_public_replacement_named_exists():
    """A warning's advice (``unison.coordinator.run_distribute_coordinator``) must itself work, without a warning."""
    for namespace, names in MOVED_NAMES.items():
        for name, moved in names.items():
            if moved.instead is None or "(" in moved.instead:
                continue
            module, _, attribute = moved.instead.rpartition(".")
            where, _, target = moved.target.partition(":")
            with warnings.catch_warnings():
                warnings.simplefilter("error", DeprecationWarning)
                public = getattr(importlib.import_module(module), attribute)
            assert public is getattr(importlib.import_module(where), target), f"{namespace}.{name}"


def test_the_warning_points_at_the_users_line(tmp_path):
    script = tmp_path / "user.py"
    script.write_text("import warnings\nwarnings.simplefilter('always')\n"
                      "import unison.reduce\n"
                      "import unison\n"
                      "unison.run_distribute_coordinator\n"
                      "from unison.launch import launch_main\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "DeprecationWarning" in line]
    assert [line.split(": DeprecationWarning")[0] for line in lines] == [
        f"{script}:3", f"{script}:5", f"{script}:6"], done.stderr


def test_an_object_pickled_by_its_old_path_loads(monkeypatch):
    for old in ("unison.values", "unison.values.aggregation"):  # first imported here, as in a fresh process
        monkeypatch.delitem(sys.modules, old, raising=False)
    monkeypatch.delitem(vars(unison), "values", raising=False)
    data = pickle.dumps(unison.VariableAggregation.SUM, protocol=0)
    assert b"unison._values.aggregation" in data
    with pytest.warns(DeprecationWarning):
        old = pickle.loads(data.replace(b"unison._values.aggregation", b"unison.values.aggregation"))
    assert old is unison.VariableAggregation.SUM


def test_the_old_namespaces_are_no_longer_public():
    assert not {"checkpoint", "cluster", "collectives", "run_distribute_coordinator"} & set(unison.__all__)
    assert "DynamicEmbedding" not in unison.embeddings.__all__ and "array_split" not in unison.placement.__all__


def test_the_changelog_lists_every_move():
    text = CHANGELOG.read_text()
    missing = [old for old in MOVED_MODULES if f"`{old}`" not in text]
    missing += [f"{ns}.{name}" for ns, names in MOVED_NAMES.items() for name in names
                if f"`{ns}.{name}`" not in text]
    assert not missing, f"CHANGELOG.md does not name {missing}"
