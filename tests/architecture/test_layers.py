"""The architecture check: unison's packages form layers, and no module imports upward.

Layers, top to bottom (a layer may import only the layers below it; packages on one line
are independent of each other):

    launch
    placement | checkpoint
    ps (the parameter-server strategy, its coordinator and runtime)
    strategies
    gradient_sync
    coordinator | collectives | input
    interpose (everything unison changes in torch, and the private torch it reads)
    context
    values | cluster
    reduce | devices | errors | _state
    _enums

Inside ``collectives`` the same rule holds between its homes, top to bottom:

    ops | compat     (the CrossDeviceOps; tensorpack's utilities)
    transport        (how bytes move)
    group            (the workers' process group and its plumbing)
    options          (CommunicationOptions)

so the worker group and the transports never import the ops that drive them, and
``compat`` is imported by no module but the package's ``__init__`` (which re-exports its
public names; everyone else, ``unison.ps`` included, imports them from there).

Imports made inside functions count (grimp reads them), so a hidden upward call through
a lazy import fails here as well; imports only made for type checking do not run and
are left out. The graph is built by grimp, import-linter's engine.
"""

from __future__ import annotations

import grimp
import pytest

LAYERS = (
    ("launch", "partitioners", "embeddings"),
    ("placement", "checkpoint"),
    ("ps",),
    ("strategies",),
    ("gradient_sync",),
    ("coordinator", "collectives", "input"),
    ("interpose",),
    ("context",),
    ("values", "cluster"),
    ("reduce", "devices", "errors", "_state"),
    ("_enums",),
)

#: The layers inside ``unison.collectives``, top to bottom, named relative to it.
COLLECTIVES_LAYERS = (
    ("ops", "compat"),
    ("transport",),
    ("group",),
    ("options",),
)
COLLECTIVES = "unison.collectives"
COMPAT = "unison.collectives.compat"


def _layers() -> list:
    return [grimp.Layer(*(f"unison.{name}" for name in names), independent=True) for names in LAYERS]


def _collectives_layers() -> list:
    return [grimp.Layer(*names, independent=True) for names in COLLECTIVES_LAYERS]


def _illegal_inside_collectives(graph: grimp.ImportGraph) -> set:
    return graph.find_illegal_dependencies_for_layers(layers=_collectives_layers(), containers={COLLECTIVES})


def _compat_importers(graph: grimp.ImportGraph) -> list[str]:
    """Modules outside ``compat`` and other than the ``collectives`` package that import ``compat``."""
    compat = {COMPAT} | graph.find_descendants(COMPAT)
    importers = {importer for module in compat for importer in graph.find_modules_that_directly_import(module)}
    return sorted(importers - compat - {COLLECTIVES})


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


def test_every_collectives_module_is_in_a_collectives_layer(graph):
    homes = [f"{COLLECTIVES}.{name}" for names in COLLECTIVES_LAYERS for name in names]
    stray = sorted(m for m in graph.modules if m.startswith(f"{COLLECTIVES}.")
                   and not any(m == home or m.startswith(f"{home}.") for home in homes))
    assert not stray, f"collectives modules in no layer: {stray}; move them into a home or add it to COLLECTIVES_LAYERS"


def test_inside_collectives_no_module_imports_a_higher_layer(graph):
    illegal = _illegal_inside_collectives(graph)
    assert not illegal, "upward or sideways imports inside collectives:\n" + _describe(illegal)


def test_compat_is_imported_only_by_the_collectives_package(graph):
    importers = _compat_importers(graph)
    assert not importers, (f"{importers} import {COMPAT}: import its public names from {COLLECTIVES} instead, "
                           f"or move what they need out of compat")


def test_the_collectives_checks_catch_added_imports():
    graph = grimp.build_graph("unison", exclude_type_checking_imports=True)
    graph.add_import(importer="unison.collectives.group.worker_control", imported="unison.collectives.ops.base")
    graph.add_import(importer="unison.collectives.transport.packing", imported="unison.collectives.ops.local")
    graph.add_import(importer="unison.collectives.ops.local", imported="unison.collectives.compat.tensorpack")
    graph.add_import(importer="unison.strategies.base", imported="unison.collectives.compat.placement")
    illegal = {(d.importer, d.imported) for d in _illegal_inside_collectives(graph)}
    assert {("unison.collectives.group", "unison.collectives.ops"),
            ("unison.collectives.transport", "unison.collectives.ops"),
            ("unison.collectives.ops", "unison.collectives.compat")} <= illegal, illegal
    assert _compat_importers(graph) == ["unison.collectives.ops.local", "unison.strategies.base"]
