"""Gradient synchronisers drive bucket transports through their contract only.

``gradient_sync`` may name the contract (``BucketTransport``, ``GradientBucket``,
``HandOut``) and the cross-worker transport protocol, never a concrete transport: a new
way of moving gradients is a new final class in ``collectives``, not a branch in a
synchroniser.
"""

from __future__ import annotations

import ast
import inspect
import pathlib

import pytest

import unison._gradient_sync
from unison._collectives.transport import bucket_transports, cross_worker, shared_buckets

pytestmark = pytest.mark.timeout(30)

CONCRETE = sorted(
    name for module in (bucket_transports, shared_buckets, cross_worker) for name, value in vars(module).items()
    if inspect.isclass(value) and value.__module__ == module.__name__ and getattr(value, "__final__", False)
)


def _names(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    names |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    names |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names}
    return names


def test_the_concrete_transports_are_found():
    assert {"AllReduceBuckets", "SharedMemoryBuckets", "PipelinedHostBuckets", "CompressedBuckets",
            "PowerSGDBuckets", "PackedTransport", "HierarchicalTransport"} <= set(CONCRETE)


def test_gradient_sync_names_no_transport_class():
    offenders = []
    paths = sorted(pathlib.Path(unison._gradient_sync.__file__).parent.rglob("*.py"))  # subpackages too
    assert {"buckets.py", "replica_merge.py"} <= {path.name for path in paths}, paths
    for path in paths:
        named = _names(path) & set(CONCRETE)
        offenders += [f"{path.name}: {name}" for name in sorted(named)]
    assert not offenders, offenders
