"""Outside ``unison._values``, a variable's strategy is read through ``distribute_strategy``.

``DistributedVariable._strategy`` is the variable's own state; other packages read the
public property (TensorFlow's ``Variable.distribute_strategy``), so the variable can change
how it keeps its strategy without the strategies, the gradient sync or the interpositions
reaching into it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import unison

ROOT = Path(unison.__file__).parent


def _private_strategy_reads(tree: ast.AST) -> list[int]:
    """Lines reading ``<something other than self>._strategy``."""
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr == "_strategy"
            and not (isinstance(node.value, ast.Name) and node.value.id == "self")]


def test_no_module_outside_values_reads_a_variables_private_strategy():
    found = {path.relative_to(ROOT).as_posix(): lines for path in ROOT.rglob("*.py")
             if path.relative_to(ROOT).parts[0] != "_values"
             and (lines := _private_strategy_reads(ast.parse(path.read_text())))}
    assert not found, f"read variable.distribute_strategy instead of variable._strategy: {found}"


def test_the_scan_catches_a_read():
    assert _private_strategy_reads(ast.parse("x = param._strategy\ny = self._strategy")) == [1]


def test_distribute_strategy_is_the_variables_strategy():
    strategy = unison.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        variable = unison.Variable(1.0)
    assert variable.distribute_strategy is strategy
