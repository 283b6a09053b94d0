"""Dedicated parameter servers: name hashing, ps groups, and subnetwork_devices' hook."""

from __future__ import annotations

import contextlib
import hashlib
import pickle
import types

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import unison
from unison._placement import ParameterPlacementHook, PsGroupAssigner, array_split
from unison.placement import (
    OpNameHashStrategy,
    PlacementConfig,
    ReplicationStrategy,
    RoundRobinStrategy,
    subnetwork_ps_group,
)


def test_op_name_hash_values():
    assert [OpNameHashStrategy(3)(name) for name in ("foo", "bar", "baz")] == [2, 0, 1]
    assert [OpNameHashStrategy(6)(name) for name in ("foo", "bar", "baz")] == [2, 3, 4]
    assert [OpNameHashStrategy(1)(name) for name in ("foo", "bar", "baz")] == [0, 0, 0]


def test_op_name_hash_rejects_bad_input():
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ValueError, match=rf"num_tasks >= 1, got {bad!r}"):
            OpNameHashStrategy(bad)
    with pytest.raises(TypeError, match="hashes names \\(str\\), got bytes"):
        OpNameHashStrategy(3)(b"foo")


@given(length=st.integers(0, 40), sections=st.integers(1, 12))
def test_array_split_is_contiguous_and_balanced(length, sections):
    parts = array_split(length, sections)
    assert len(parts) == sections
    assert [i for part in parts for i in part] == list(range(length))
    sizes = [len(part) for part in parts]
    assert sizes == sorted(sizes, reverse=True) and max(sizes) - min(sizes) <= 1


def test_array_split_matches_numpy():
    np = pytest.importorskip("numpy")
    for length in range(0, 12):
        for sections in range(1, 8):
            expected = [list(part) for part in np.array_split(np.arange(length), sections)]
            assert [list(part) for part in array_split(length, sections)] == expected


@pytest.mark.parametrize("num_subnetworks", range(1, 6))
@pytest.mark.parametrize("num_ps", range(1, 9))
def test_ps_group_invariants(num_ps, num_subnetworks):
    groups = [subnetwork_ps_group(num_ps, num_subnetworks, i) for i in range(num_subnetworks)]
    for group in groups:
        assert len(group) >= 1
        assert set(group) <= set(range(num_ps))
    assert set().union(*map(set, groups)) == set(range(num_ps))  # every ps task serves a subnetwork
    if num_subnetworks <= num_ps:
        assert sum(len(g) for g in groups) == num_ps  # disjoint
    else:
        assert [list(g) for g in groups] == [[i % num_ps] for i in range(num_subnetworks)]


def test_ps_group_rejects_bad_input():
    with pytest.raises(ValueError, match="num_ps_replicas >= 1, got 0"):
        subnetwork_ps_group(0, 3, 0)
    with pytest.raises(ValueError, match="subnetwork_index 3 is out of range"):
        subnetwork_ps_group(2, 3, 3)
    with pytest.raises(ValueError, match="num_subnetworks must be an integer >= 1"):
        subnetwork_ps_group(2, 0, 0)
    for bad in (range(0), range(0, 4, 2), [0, 1]):
        with pytest.raises(ValueError, match="non-empty range of ps task indices with step 1"):
            PsGroupAssigner(bad)


def sha_task(group: range, name: str) -> int:
    return group[0] + int(hashlib.sha256(name.encode()).hexdigest(), 16) % len(group)


def test_assigner_hashes_inside_its_group_and_pickles():
    assign = PsGroupAssigner(range(3, 6))
    assert [assign(name) for name in ("foo", "bar", "baz")] == [5, 3, 4]
    assert pickle.loads(pickle.dumps(assign)) == assign


# -- subnetwork_devices and the hook ---------------------------------------------------


class FakePolicy:
    """A variable policy implementing the ParameterPlacementHook contract by recording what it was asked."""

    def __init__(self):
        self.calls = []  # one dict per place_parameters_in context

    @contextlib.contextmanager
    def place_parameters_in(self, assign):
        call = {"assign": assign, "exited": False, "error": None}
        self.calls.append(call)
        try:
            yield
        except BaseException as e:
            call["error"] = e
            raise
        finally:
            call["exited"] = True


class FakePsStrategy:
    def __init__(self):
        policy = FakePolicy()
        self.extended = types.SimpleNamespace(components=types.SimpleNamespace(variable_policy=policy),
                                              calls=policy.calls)


@pytest.fixture
def fake_ps_strategy(monkeypatch):
    strategy = FakePsStrategy()
    monkeypatch.setattr(unison._strategies.current, "get_strategy", lambda: strategy)
    return strategy


def round_robin(num_ps, num_workers=4, index=1, **kwargs):
    placement = RoundRobinStrategy(**kwargs)
    placement.config = PlacementConfig(num_worker_replicas=num_workers, global_id_in_cluster=index,
                                       num_ps_replicas=num_ps)
    return placement


def build_subnetwork(depth: int) -> torch.nn.Module:
    return torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(depth)])


def test_fake_satisfies_the_protocol_and_real_local_strategies_do_not():
    assert isinstance(FakePolicy(), ParameterPlacementHook)
    assert not isinstance(unison.MirroredStrategy(["cpu:0", "cpu:1"]).extended.components.variable_policy,
                          ParameterPlacementHook)
    assert not isinstance(unison.get_strategy().extended.components.variable_policy, ParameterPlacementHook)


@pytest.mark.parametrize("num_ps, num_subnetworks", [(1, 1), (2, 2), (4, 2), (5, 3), (2, 5), (8, 5), (3, 3)])
def test_subnetwork_devices_places_each_subnetwork_on_its_group(fake_ps_strategy, num_ps, num_subnetworks):
    placement = round_robin(num_ps)
    seen_tasks = []
    for i in range(num_subnetworks):
        with placement.subnetwork_devices(num_subnetworks, i):
            module = build_subnetwork(depth=3)
        call = fake_ps_strategy.extended.calls[-1]
        assert call["exited"] and call["error"] is None
        group = subnetwork_ps_group(num_ps, num_subnetworks, i)
        placed = {name: call["assign"](name) for name, _ in module.named_parameters()}
        assert placed == {name: sha_task(group, name) for name, _ in module.named_parameters()}
        seen_tasks.append(set(placed.values()))
    assert len(fake_ps_strategy.extended.calls) == num_subnetworks
    if num_subnetworks <= num_ps:  # dedicated groups: no two subnetworks share a ps task
        for a in range(num_subnetworks):
            for b in range(a + 1, num_subnetworks):
                assert not seen_tasks[a] & seen_tasks[b]


def test_subnetwork_devices_spreads_a_group_by_name_hash(fake_ps_strategy):
    # 4 ps for 2 subnetworks: subnetwork 1 owns ps 2 and 3, and its 6 parameters use both
    with round_robin(num_ps=4).subnetwork_devices(2, 1):
        module = build_subnetwork(depth=3)
    assign = fake_ps_strategy.extended.calls[-1]["assign"]
    assert {assign(name) for name, _ in module.named_parameters()} == {2, 3}


def test_an_error_inside_reaches_the_hook_and_the_caller(fake_ps_strategy):
    with pytest.raises(RuntimeError, match="boom"):
        with round_robin(num_ps=2).subnetwork_devices(2, 0):
            raise RuntimeError("boom")
    call = fake_ps_strategy.extended.calls[-1]
    assert call["exited"] and isinstance(call["error"], RuntimeError)


@pytest.mark.parametrize(
    "make",
    [
        lambda: round_robin(num_ps=2, dedicate_parameter_servers=False),
        lambda: round_robin(num_ps=0),
        lambda: _configured(ReplicationStrategy(), num_ps=2),
    ],
    ids=["dedicate_parameter_servers=False", "no ps", "ReplicationStrategy"],
)
def test_default_placement_cases_do_not_call_the_hook(fake_ps_strategy, make):
    with make().subnetwork_devices(3, 1):
        build_subnetwork(depth=1)
    assert fake_ps_strategy.extended.calls == []


def _configured(placement, num_ps):
    placement.config = PlacementConfig(num_worker_replicas=2, global_id_in_cluster=0, num_ps_replicas=num_ps)
    return placement


def test_no_op_under_mirrored_strategy_and_without_strategy():
    strategy = unison.MirroredStrategy(["cpu:0", "cpu:1"])
    placement = round_robin(num_ps=2)
    with strategy.scope():
        with placement.subnetwork_devices(2, 0):
            inside = build_subnetwork(depth=1)
        outside = build_subnetwork(depth=1)
    assert [type(p) for p in inside.parameters()] == [type(p) for p in outside.parameters()]
    with placement.subnetwork_devices(2, 1):  # default strategy: plain parameters
        plain = build_subnetwork(depth=1)
    assert all(type(p) is torch.nn.Parameter for p in plain.parameters())
