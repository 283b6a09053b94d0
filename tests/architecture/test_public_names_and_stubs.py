"""The public API: the names tf.distribute users look for, documented members, lazy stubs, import cost.

That every public namespace's names resolve, are documented and have public paths is
checked for all of them at once in ``tests/architecture/test_public_api.py``.
"""

from __future__ import annotations

import importlib
import inspect

import pytest

import unison


@pytest.mark.parametrize(
    "name",
    ["MirroredStrategy", "CentralStorageStrategy", "OneDeviceStrategy", "ReduceOp", "ReplicaContext", "Variable",
     "MirroredVariable", "SyncOnReadVariable", "PerReplica", "Mirrored", "get_replica_context", "get_strategy",
     "has_strategy", "in_cross_replica_context", "select_cross_device_ops", "NcclAllReduce",
     "HierarchicalCopyAllReduce", "ReductionToOneDevice", "AllReduceCrossDeviceOps", "CrossDeviceOps",
     "VariableAggregation", "VariableSynchronization", "Strategy", "StrategyExtended"],
)
def test_issue_2_names_are_exported(name):
    assert name in unison.__all__


# Undocumented public members in files this suite does not own; each entry must still be
# undocumented (so the list shrinks when someone adds the docstring).
KNOWN_UNDOCUMENTED: set[str] = set()


def test_public_members_of_core_classes_are_documented():
    from unison._values.variables import DistributedVariable

    missing = set()
    for cls in (unison.Strategy, unison.StrategyExtended, unison.ReplicaContext, unison.DistributedValues,
                DistributedVariable, unison.MirroredVariable, unison.SyncOnReadVariable, unison.CrossDeviceOps,
                unison.ReduceOp, unison.VariableAggregation, unison.VariableSynchronization):
        for attr, member in vars(cls).items():
            if attr.startswith("_") or not (callable(member) or isinstance(member, (property, classmethod))):
                continue
            if not inspect.getdoc(member):
                missing.add(f"{cls.__name__}.{attr}")
    assert missing == KNOWN_UNDOCUMENTED


#: The packages whose names load on first use, each from its ``__init__.pyi`` stub: the public ones, and the
#: internal ones that the launcher reads without torch.
LAZY_PACKAGES = ["unison", "unison.coordinator", "unison.embeddings", "unison._checkpoint", "unison._cluster",
                 "unison._coordinator", "unison._embeddings"]


@pytest.mark.parametrize("package", LAZY_PACKAGES)
def test_a_lazy_package_exports_exactly_what_its_stub_declares(package):
    """The run-time names (read from the stub's imports) are the stub's ``__all__``, which type checkers read."""
    import ast
    from pathlib import Path

    module = importlib.import_module(package)
    stub = ast.parse(Path(module.__file__).with_suffix(".pyi").read_text())
    declared = next(ast.literal_eval(node.value) for node in stub.body
                    if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "__all__")
    assert sorted(module.__all__) == sorted(declared)
    assert set(dir(module)) >= set(declared)
    for name in declared:
        getattr(module, name)  # AttributeError if the stub names something its module lacks


@pytest.mark.timeout(200)
def test_import_unison_costs_no_torch_until_a_name_is_used():
    import subprocess
    import sys

    def fresh(code: str) -> list[str]:
        # the timeout only ends a hang: three fresh interpreters importing torch took over 25 s at load 12
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout.splitlines()

    assert fresh("import sys, unison, unison.coordinator, unison.embeddings, unison.launch, unison.errors\n"
                 "import unison._checkpoint, unison._cluster\n"
                 "print('torch' in sys.modules)\n"
                 "name = type(unison.MirroredStrategy()).__name__\n"
                 "print('torch' in sys.modules, name)\n"
                 "import unison.partitioners as p, unison._ps.remote_variables.shard_partitioners as q\n"
                 "print(p is unison.partitioners and p.FixedShardsPartitioner is q.FixedShardsPartitioner)\n"
                 ) == ["False", "True MirroredStrategy", "True"]
    # the public modules, reached as attributes first thing in a fresh process
    assert fresh("import unison\nprint(issubclass(unison.errors.PeerLostError, unison.errors.UnisonError))") == ["True"]
    assert fresh("import unison\nprint(callable(unison.tensorpack.allreduce_grads), "
                 "callable(unison.coordinator.run_distribute_coordinator), callable(unison.embeddings.Normal), "
                 "callable(unison.placement.RoundRobinStrategy))") == ["True True True True"]
