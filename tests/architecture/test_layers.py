"""The architecture check: unison's packages form layers, and no module imports upward.

Layers, top to bottom (a layer may import only the layers below it; packages on one line
are independent of each other):

    launch
    placement | checkpoint
    ps (the parameter-server strategy, its coordinator and runtime)
    strategies
    gradient_sync
    collectives | input
    context
    values | cluster
    reduce | devices | errors | _state | _once
    _enums

Imports made inside functions count (grimp reads them), so a hidden upward call through
a lazy import fails here as well; imports only made for type checking do not run and
are left out. The graph is built by grimp, import-linter's engine.
"""

from __future__ import annotations

import grimp
import pytest

LAYERS = (
    ("launch", "partitioners"),
    ("placement", "checkpoint"),
    ("ps",),
    ("strategies",),
    ("gradient_sync",),
    ("coordinator", "collectives", "input"),
    ("context",),
    ("values", "cluster"),
    ("reduce", "devices", "errors", "_state", "_once"),
    ("_enums",),
)


def _layers() -> list:
    return [grimp.Layer(*(f"unison.{name}" for name in names), independent=True) for names in LAYERS]


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph("unison", exclude_type_checking_imports=True)


def _describe(dependencies: set) -> str:
    lines = []
    for dependency in sorted(dependencies, key=lambda d: (d.importer, d.imported)):
        for route in dependency.routes:
            lines.append(f"{dependency.importer} -> {dependency.imported}: via {' -> '.join(route.heads)} ... "
                         f"{' -> '.join(route.tails)}")
    return "\n".join(lines)


def test_every_package_is_in_a_layer(graph):
    packages = {m.split(".")[1] for m in graph.modules if m.count(".") >= 1} - {"_testing"}
    layered = {name for names in LAYERS for name in names}
    assert packages <= layered, f"packages in no layer: {sorted(packages - layered)}; add them to LAYERS"


def test_no_module_imports_a_higher_layer(graph):
    illegal = graph.find_illegal_dependencies_for_layers(layers=_layers(), containers=set())
    assert not illegal, "upward or sideways imports between layers:\n" + _describe(illegal)


def test_the_check_catches_an_added_upward_import():
    graph = grimp.build_graph("unison", exclude_type_checking_imports=True)
    graph.add_import(importer="unison.values.variables", imported="unison.strategies.base")
    illegal = graph.find_illegal_dependencies_for_layers(layers=_layers(), containers=set())
    assert any(d.importer == "unison.values" and d.imported == "unison.strategies" for d in illegal), illegal


def test_no_import_cycles_between_modules(graph):
    cycles = []
    for module in sorted(graph.modules):
        for imported in graph.find_modules_directly_imported_by(module):
            if imported.startswith("unison.") and graph.chain_exists(importer=imported, imported=module):
                cycles.append(f"{module} <-> {imported}")
    assert not cycles, "import cycles:\n" + "\n".join(cycles)
