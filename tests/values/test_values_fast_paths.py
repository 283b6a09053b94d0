"""``select_replica`` and ``regroup`` skip pytree for plain structures: same answers as pytree.

They run several times per ``strategy.run`` (arguments, results, merge arguments and
results); the fast paths must give what the pytree walk gives.
"""

from __future__ import annotations

import collections

import torch
from torch.utils import _pytree as pytree

import unison
from unison._values.values import PerReplica, is_distributed, regroup, select_replica

Point = collections.namedtuple("Point", "x y")


def _select_by_pytree(replica_id, structure):
    def pick(leaf):
        return leaf.values[replica_id] if isinstance(leaf, PerReplica) else leaf

    return pytree.tree_map(pick, structure, is_leaf=is_distributed)


def test_select_replica_matches_pytree_on_plain_and_other_structures():
    a, b, c = torch.ones(1), torch.zeros(1), torch.full((1,), 2.0)
    structures = [
        None,
        (PerReplica([a, b]),),
        ((PerReplica([a, b]), c), {"k": [PerReplica([b, a]), 3, "s"]}),
        (Point(PerReplica([a, b]), c),),  # a namedtuple: pytree's walk
        [],
        {},
    ]
    for structure in structures:
        for replica_id in (0, 1):
            fast = select_replica(replica_id, structure)
            slow = _select_by_pytree(replica_id, structure)
            assert type(fast) is type(slow)
            assert pytree.tree_structure(fast) == pytree.tree_structure(slow)
            assert all(x is y for x, y in zip(pytree.tree_leaves(fast), pytree.tree_leaves(slow)))


def test_regroup_of_identical_structures_returns_them():
    shared = torch.ones(2)
    assert regroup([None, None]) is None
    first = ([shared], {"lr": 0.1})
    assert regroup([first, ([shared], {"lr": 0.1})]) is first  # the same leaves in other containers


def test_regroup_of_differing_leaves_still_builds_per_replica():
    a, b = torch.ones(1), torch.zeros(1)
    grouped = regroup([(a, 1), (b, 1)])
    assert isinstance(grouped[0], PerReplica) and grouped[0].values == (a, b) and grouped[1] == 1


def test_run_with_per_replica_arguments_and_none_results():
    strategy = unison.MirroredStrategy(["cpu:0", "cpu:1"])
    seen = []
    out = strategy.run(lambda x, k=None: seen.append((unison.get_replica_context().replica_id_in_sync_group, x, k)),
                       args=(PerReplica([1, 2]),), kwargs={"k": PerReplica(["a", "b"])})
    assert out is None and sorted(seen) == [(0, 1, "a"), (1, 2, "b")]
