"""Placement strategies: the drop_remainder warning, the unset config, argument checks."""

from __future__ import annotations

import re
import warnings

import pytest

import unison
from unison.errors import PlacementError, UnisonError
from unison.placement import PlacementConfig, PlacementStrategy, ReplicationStrategy, RoundRobinStrategy


def configured(placement: PlacementStrategy, num_workers: int, index: int = 0, num_ps: int = 0) -> PlacementStrategy:
    placement.config = PlacementConfig(num_worker_replicas=num_workers, global_id_in_cluster=index,
                                       num_ps_replicas=num_ps)
    return placement


QUERIES = [
    ("should_build_ensemble", lambda p, n: p.should_build_ensemble(n)),
    ("should_build_subnetwork", lambda p, n: p.should_build_subnetwork(n, 0)),
    ("should_train_subnetworks", lambda p, n: p.should_train_subnetworks(n)),
]


@pytest.mark.parametrize(
    "num_workers, num_subnetworks, dropped",
    [
        (2, 3, "2 subnetwork(s), indices 1..2"),  # AdaNet's message says 0
        (3, 3, "1 subnetwork(s), indices 2..2"),  # AdaNet is silent here
        (2, 5, "4 subnetwork(s), indices 1..4"),
        (4, 5, "2 subnetwork(s), indices 3..4"),
    ],
)
@pytest.mark.parametrize("query", [q for _, q in QUERIES], ids=[name for name, _ in QUERIES])
def test_drop_remainder_warns_with_the_right_count(num_workers, num_subnetworks, dropped, query):
    for index in range(num_workers):
        placement = configured(RoundRobinStrategy(drop_remainder=True), num_workers, index)
        with pytest.warns(UserWarning, match=re.escape(f"drops {dropped}")) as record:
            query(placement, num_subnetworks)
        assert len(record) == 1
        # stacklevel points at the caller: the lambda in this file, not unison's code
        assert record[0].filename == __file__


@pytest.mark.parametrize(
    "num_workers, num_subnetworks, drop_remainder",
    [(4, 3, True), (8, 3, True), (1, 5, True), (6, 1, True), (2, 3, False), (3, 3, False)],
)
def test_no_warning_when_nothing_is_dropped(num_workers, num_subnetworks, drop_remainder):
    placement = configured(RoundRobinStrategy(drop_remainder=drop_remainder), num_workers, num_workers - 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _, query in QUERIES:
            query(placement, num_subnetworks)


@pytest.mark.parametrize("placement", [ReplicationStrategy(), RoundRobinStrategy()], ids=repr)
def test_use_before_config_is_a_placement_error_naming_the_fix(placement):
    for _, query in QUERIES:
        with pytest.raises(PlacementError, match=r"has no config.*PlacementConfig\.from_strategy\(strategy\)"):
            query(placement, 3)
    with pytest.raises(PlacementError, match="has no config"):
        with placement.subnetwork_devices(3, 0):
            pass
    with pytest.raises(PlacementError, match="has no config"):
        _ = placement.config
    assert issubclass(PlacementError, UnisonError) and issubclass(PlacementError, RuntimeError)


def test_config_must_be_a_placement_config():
    placement = RoundRobinStrategy()
    with pytest.raises(TypeError, match=r"config must be a unison\.placement\.PlacementConfig, got dict"):
        placement.config = {"num_worker_replicas": 2}
    config = PlacementConfig(num_worker_replicas=2, global_id_in_cluster=1, num_ps_replicas=1)
    placement.config = config
    assert placement.config is config


@pytest.mark.parametrize("placement", [ReplicationStrategy(), RoundRobinStrategy()], ids=repr)
def test_bad_arguments_name_field_and_value(placement):
    configured(placement, 4, 1)
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match=rf"num_subnetworks must be an integer >= 1.*got {re.escape(repr(bad))}"):
            placement.should_build_ensemble(bad)
        with pytest.raises(ValueError, match="fix `num_subnetworks`"):
            placement.should_train_subnetworks(bad)
    for index in (-1, 3, 1.0, None):
        with pytest.raises(ValueError,
                           match=rf"subnetwork_index {re.escape(repr(index))} is out of range.*valid 0\.\.2"):
            placement.should_build_subnetwork(3, index)
    with pytest.raises(ValueError, match="subnetwork_index 5 is out of range"):
        with placement.subnetwork_devices(3, 5):
            pass


def test_round_robin_options_are_bools():
    with pytest.raises(TypeError, match="drop_remainder=...\\) must be a bool, got 1"):
        RoundRobinStrategy(drop_remainder=1)
    with pytest.raises(TypeError, match="dedicate_parameter_servers"):
        RoundRobinStrategy(dedicate_parameter_servers="yes")
    placement = RoundRobinStrategy(drop_remainder=True, dedicate_parameter_servers=False)
    assert (placement.drop_remainder, placement.dedicate_parameter_servers) == (True, False)
    assert repr(placement) == "RoundRobinStrategy(drop_remainder=True, dedicate_parameter_servers=False)"


def test_placement_strategy_is_abstract_and_exported():
    with pytest.raises(TypeError):
        PlacementStrategy()
    assert unison.placement.RoundRobinStrategy is RoundRobinStrategy
    assert "placement" in unison.__all__


def test_none_index_counts_as_worker_zero():
    placement = configured(RoundRobinStrategy(), 4, 0)
    placement.config = PlacementConfig(num_worker_replicas=4, global_id_in_cluster=None)
    assert placement.should_build_ensemble(3) and not placement.should_train_subnetworks(3)
