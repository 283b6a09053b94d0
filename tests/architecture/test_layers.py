"""The architecture check: unison's packages form layers, and no module imports upward.

Layers, top to bottom (a layer may import only the layers below it; packages on one line
are independent of each other). The public face is the top layer: no internal module
imports a public facade, and every internal package has an underscored path (PyTorch's
rule; ``tests/architecture/test_public_api.py``):

    coordinator | embeddings | launch | optim | partitioners | placement | progress | tensorpack  (public face)
    _launch (the ``unison`` command: it starts clusters, standard servers and serving processes)
    _embeddings.serving (the serving export of a trained module, and the read-only module a
                         serving process loads it into: it reads a DynamicEmbedding, so it sits
                         above the modules; a serving process imports it without training code)
    _embeddings.modules (the modules a model author builds)
    _placement | _checkpoint
    _ps (the parameter-server strategies, the chief, workers, ps tasks and the wire)
    _strategies
    _gradient_sync
    _coordinator | _collectives | _input
    _embeddings.tables (the Table contract, the local table that ps tasks run too)
    _embeddings.optim (row optimizers)
    _interpose (everything unison changes in torch, and the private torch it reads) | _optim (Ftrl)
    _context
    _values | _cluster
    _reduce | _devices | errors | _state
    _enums | _deprecation | _facades (the machinery of the public face)

Inside ``_collectives`` the same rule holds between its homes, top to bottom:

    ops | compat     (the CrossDeviceOps; tensorpack's utilities)
    transport        (how bytes move)
    group            (the workers' process group and its plumbing)
    options          (CommunicationOptions)

so the worker group and the transports never import the ops that drive them. Inside
``_ps``, by role and by the process that runs the code:

    chief            (the chief's ClusterCoordinator, its queue, remote values and datasets)
    strategy | hybrid_strategy  (the two strategies: a coordinator is made from one)
    task_server      (the server of a worker or ps task; a hybrid worker starts the ps
                     tasks it serves with ``--ps-in-workers``)
    worker           (a worker's runtime; the remote table, client half of a dynamic table)
    remote_variables (ps variables as the chief sees them, placement, partitioners)
    task             (the ps process: parameter store, table shards, request dispatch)
    wire             (what both sides import: the typed protocol, links, the client)

and inside ``_embeddings``: ``serving`` above ``modules`` above ``tables`` above ``optim``. And
``compat`` is imported by no module but the package's ``__init__`` (which re-exports its
public names; everyone else, ``unison._ps`` included, imports them from there).

Imports made inside functions count (grimp reads them), so a hidden upward call through
a lazy import fails here as well; imports only made for type checking do not run and
are left out. The graph is built by grimp, import-linter's engine.
"""

from __future__ import annotations

from pathlib import Path

import grimp
import pytest

import unison

LAYERS = (
    ("coordinator", "embeddings", "launch", "optim", "partitioners", "placement", "progress", "tensorpack"),
    ("_launch",),
    ("_embeddings.serving",),
    ("_embeddings.modules",),
    ("_placement", "_checkpoint"),
    ("_ps",),
    ("_strategies",),
    ("_gradient_sync",),
    ("_coordinator", "_collectives", "_input"),
    ("_embeddings.tables",),
    ("_embeddings.optim",),
    ("_interpose", "_optim"),
    ("_context",),
    ("_values", "_cluster"),
    ("_reduce", "_devices", "errors", "_state"),
    ("_enums", "_deprecation", "_facades", "_durable"),
)

#: The layers inside ``unison._collectives``, top to bottom, named relative to it.
COLLECTIVES_LAYERS = (
    ("ops", "compat"),
    ("transport",),
    ("group",),
    ("options",),
)
COLLECTIVES = "unison._collectives"

#: The layers inside ``unison._ps``, top to bottom, by role and process.
PS_LAYERS = (
    ("chief",),
    ("strategy", "hybrid_strategy"),
    ("task_server",),
    ("worker",),
    ("remote_variables",),
    ("task",),
    ("wire",),
)
PS = "unison._ps"

#: The layers inside ``unison._embeddings``.
EMBEDDINGS_LAYERS = (("serving",), ("modules",), ("tables",), ("optim",))
EMBEDDINGS = "unison._embeddings"

#: At most this many modules directly in ``unison._ps`` (more means a role needs its own package).
MAX_PS_TOP_MODULES = 10

#: One meaning per name: at most one module of each of these names in all of ``unison``.
AMBIGUOUS_NAMES = ("store", "server", "coordinator", "values", "variables", "dataset", "placement", "partitioners")
COMPAT = "unison._collectives.compat"


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
    layered = {name.split(".")[0] for names in LAYERS for name in names}
    assert packages <= layered, f"packages in no layer: {sorted(packages - layered)}; add them to LAYERS"


def test_no_module_imports_a_higher_layer(graph):
    illegal = graph.find_illegal_dependencies_for_layers(layers=_layers(), containers=set())
    assert not illegal, "upward or sideways imports between layers:\n" + _describe(illegal)


def test_the_check_catches_an_added_upward_import():
    graph = grimp.build_graph("unison", exclude_type_checking_imports=True)
    graph.add_import(importer="unison._values.variables", imported="unison._strategies.base")
    illegal = graph.find_illegal_dependencies_for_layers(layers=_layers(), containers=set())
    assert any(d.importer == "unison._values" and d.imported == "unison._strategies" for d in illegal), illegal


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
    graph.add_import(importer="unison._collectives.group.worker_control", imported="unison._collectives.ops.base")
    graph.add_import(importer="unison._collectives.transport.packing", imported="unison._collectives.ops.local")
    graph.add_import(importer="unison._collectives.ops.local", imported="unison._collectives.compat.tensorpack")
    graph.add_import(importer="unison._strategies.base", imported="unison._collectives.compat.placement")
    illegal = {(d.importer, d.imported) for d in _illegal_inside_collectives(graph)}
    assert {("unison._collectives.group", "unison._collectives.ops"),
            ("unison._collectives.transport", "unison._collectives.ops"),
            ("unison._collectives.ops", "unison._collectives.compat")} <= illegal, illegal
    assert _compat_importers(graph) == ["unison._collectives.ops.local", "unison._strategies.base"]


def _sub_layers(layers: tuple) -> list:
    return [grimp.Layer(*names, independent=True) for names in layers]


def _stray(graph: grimp.ImportGraph, container: str, layers: tuple) -> list[str]:
    homes = [f"{container}.{name}" for names in layers for name in names]
    return sorted(m for m in graph.modules if m.startswith(f"{container}.")
                  and not any(m == home or m.startswith(f"{home}.") for home in homes))


@pytest.mark.parametrize("container, layers", [(PS, PS_LAYERS), (EMBEDDINGS, EMBEDDINGS_LAYERS)])
def test_every_module_of_ps_and_embeddings_is_in_a_layer(graph, container, layers):
    stray = _stray(graph, container, layers)
    assert not stray, f"{container} modules in no layer: {stray}; move them into a sub-package or add it to the layers"


@pytest.mark.parametrize("container, layers", [(PS, PS_LAYERS), (EMBEDDINGS, EMBEDDINGS_LAYERS)])
def test_inside_ps_and_embeddings_no_module_imports_a_higher_layer(graph, container, layers):
    illegal = graph.find_illegal_dependencies_for_layers(layers=_sub_layers(layers), containers={container})
    assert not illegal, f"upward or sideways imports inside {container}:\n" + _describe(illegal)


def test_the_ps_checks_catch_added_imports():
    graph = grimp.build_graph("unison", exclude_type_checking_imports=True)
    graph.add_import(importer="unison._ps.wire.client", imported="unison._ps.task.parameter_store")
    graph.add_import(importer="unison._ps.task.table_shards", imported="unison._ps.worker.remote_table")
    graph.add_import(importer="unison._embeddings.tables.local_table",
                     imported="unison._embeddings.modules.row_updates")
    illegal = {(d.importer, d.imported) for d in graph.find_illegal_dependencies_for_layers(
        layers=_sub_layers(PS_LAYERS), containers={PS})}
    assert {("unison._ps.wire", "unison._ps.task"), ("unison._ps.task", "unison._ps.worker")} <= illegal, illegal
    illegal = {(d.importer, d.imported) for d in graph.find_illegal_dependencies_for_layers(
        layers=_sub_layers(EMBEDDINGS_LAYERS), containers={EMBEDDINGS})}
    assert ("unison._embeddings.tables", "unison._embeddings.modules") in illegal, illegal


def test_ps_keeps_at_most_ten_modules_at_its_top(graph):
    top = sorted(m for m in graph.modules if m.startswith(f"{PS}.") and m.count(".") == 2)
    assert len(top) <= MAX_PS_TOP_MODULES, f"{len(top)} modules directly in {PS}: {top}; group them by role"


def test_one_module_per_ambiguous_name():
    root = Path(unison.__file__).parent
    by_name: dict[str, list[str]] = {}
    for path in root.rglob("*.py"):
        if path.stem in AMBIGUOUS_NAMES:
            by_name.setdefault(path.stem, []).append(path.relative_to(root).as_posix())
    shared = {name: sorted(modules) for name, modules in by_name.items() if len(modules) > 1}
    assert not shared, f"one name, several modules (name each for what it holds): {shared}"
