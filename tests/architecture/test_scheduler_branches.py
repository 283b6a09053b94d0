"""Each scheduler's knowledge lives in its class: nothing outside the resolvers asks for it by name.

A scheduler's conventions (local rank, rendezvous token and kind, CPU share, restart
advice) are methods of its ``unison._cluster.scheduler.Scheduler``, named by its resolver
and carried by the resolved cluster. A branch on the environment's name elsewhere
(``if environment == "slurm"``, ``{"torchrun": ...}.get(environment)``) spreads one
scheduler over several modules again; this check finds such branches by reading every
module's syntax tree.
"""

from __future__ import annotations

import ast
import pathlib

import unison

#: The environments' names (``ClusterResolver.environment`` and ``detect_cluster_resolver``'s).
NAMES = frozenset({"slurm", "torchrun", "tf_config", "sagemaker"})

#: The modules where a name may pick a scheduler: the resolvers, the detection walk, the
#: scheduler contract and its lookup by name.
ALLOWED = frozenset({
    "unison._cluster.torchrun", "unison._cluster.slurm", "unison._cluster.sagemaker", "unison._cluster.tf_config",
    "unison._cluster.simple", "unison._cluster.kubernetes", "unison._cluster.union", "unison._cluster.detect",
    "unison._cluster.scheduler", "unison._cluster.known_schedulers",
})


def _is_name(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value in NAMES


def _names_in(node: ast.AST) -> bool:
    """A name itself, or a tuple / list / set of literals holding one (``x in ("slurm", ...)``)."""
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_is_name(element) for element in node.elts)
    return _is_name(node)


def scheduler_branches(source: str, filename: str = "<source>") -> list[str]:
    """Where ``source`` compares with, looks up by, or matches on an environment's name."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Compare) and any(_names_in(side) for side in [node.left, *node.comparators]):
            found.append(f"{filename}:{node.lineno}: compares with an environment's name")
        elif isinstance(node, ast.Dict) and any(key is not None and _is_name(key) for key in node.keys):
            found.append(f"{filename}:{node.lineno}: a table keyed by environment names")
        elif isinstance(node, ast.MatchValue) and _is_name(node.value):
            found.append(f"{filename}:{node.lineno}: matches on an environment's name")
    return found


def _modules() -> dict[str, pathlib.Path]:
    root = pathlib.Path(unison.__file__).parent
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def test_no_module_outside_the_resolvers_branches_on_the_scheduler():
    offenders = [line for name, path in _modules().items() if name not in ALLOWED
                 for line in scheduler_branches(path.read_text(), name)]
    assert not offenders, ("ask the resolved cluster's scheduler (`cluster.scheduler`) instead of the environment's "
                           "name:\n" + "\n".join(offenders))


def test_every_allowed_module_exists():
    assert ALLOWED <= set(_modules()), sorted(ALLOWED - set(_modules()))


def test_the_check_finds_each_form_of_branch():
    assert scheduler_branches('if environment == "slurm":\n    pass\n')
    assert scheduler_branches('ok = "torchrun" != cluster.environment\n')
    assert scheduler_branches('ok = environment in ("tf_config", "x")\n')
    assert scheduler_branches('name = {"torchrun": "LOCAL_RANK", "slurm": "SLURM_LOCALID"}.get(environment)\n')
    assert scheduler_branches('match environment:\n    case "sagemaker":\n        pass\n')
    assert not scheduler_branches('advice = cluster.scheduler.restart_advice()\nkind = "leader"\n')
