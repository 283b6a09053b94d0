"""RoundRobinStrategy / ReplicationStrategy assignment tables against an independent oracle.

The oracle deals workers into rounds of ``n + 1`` seats and, in each round, deals the
subnetworks like cards to the seats after the first; it never computes
``index % (n + 1)`` or the partial-round slot count the implementation uses.
"""

from __future__ import annotations

import itertools
import warnings

import pytest
from hypothesis import given
from hypothesis import strategies as st

from unison._placement import round_robin
from unison.placement import PlacementConfig, ReplicationStrategy, RoundRobinStrategy

SUBNETWORK_COUNTS = (1, 3, 5)
WORKER_COUNTS = range(1, 9)


def oracle(num_workers: int, num_subnetworks: int, drop_remainder: bool) -> list[tuple[bool, frozenset, bool]]:
    """Per worker: (builds the ensemble, subnetworks it builds, trains subnetworks)."""
    everything = frozenset(range(num_subnetworks))
    if num_workers == 1 or num_subnetworks == 1:
        return [(True, everything, True)] * num_workers
    table: dict[int, tuple[bool, frozenset, bool]] = {}
    workers = list(range(num_workers))
    rounds = [workers[start:start + num_subnetworks + 1] for start in range(0, num_workers, num_subnetworks + 1)]
    for members in rounds:
        ensemble_worker, *seats = members
        table[ensemble_worker] = (True, everything, False)
        hands: dict[int, set] = {seat: set() for seat in seats}
        if seats:
            if drop_remainder or len(seats) == num_subnetworks:
                cards = zip(range(num_subnetworks), seats)  # one card per seat, leftovers dropped
            else:
                cards = zip(range(num_subnetworks), itertools.cycle(seats))  # every card dealt
            for subnetwork, seat in cards:
                hands[seat].add(subnetwork)
        for seat, hand in hands.items():
            table[seat] = (False, frozenset(hand), True)
    return [table[w] for w in workers]


def observed(strategy_cls, num_workers: int, num_subnetworks: int, **kwargs) -> list[tuple[bool, frozenset, bool]]:
    rows = []
    for index in range(num_workers):
        placement = strategy_cls(**kwargs)
        placement.config = PlacementConfig(num_worker_replicas=num_workers, global_id_in_cluster=index)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # the drop warning has its own tests
            rows.append((
                placement.should_build_ensemble(num_subnetworks),
                frozenset(i for i in range(num_subnetworks) if placement.should_build_subnetwork(num_subnetworks, i)),
                placement.should_train_subnetworks(num_subnetworks),
            ))
    return rows


@pytest.mark.parametrize("drop_remainder", [False, True])
@pytest.mark.parametrize("num_subnetworks", SUBNETWORK_COUNTS)
@pytest.mark.parametrize("num_workers", WORKER_COUNTS)
def test_round_robin_table_matches_the_oracle(num_workers, num_subnetworks, drop_remainder):
    assert observed(RoundRobinStrategy, num_workers, num_subnetworks, drop_remainder=drop_remainder) == oracle(
        num_workers, num_subnetworks, drop_remainder
    )


@pytest.mark.parametrize("num_subnetworks", SUBNETWORK_COUNTS)
@pytest.mark.parametrize("num_workers", WORKER_COUNTS)
def test_replication_builds_and_trains_everything_everywhere(num_workers, num_subnetworks):
    everything = (True, frozenset(range(num_subnetworks)), True)
    assert observed(ReplicationStrategy, num_workers, num_subnetworks) == [everything] * num_workers


# A few rows written out by hand (E = ensemble worker, which builds all and trains none).
HAND_TABLES = {
    # (workers, subnetworks, drop_remainder): [subnetworks built per worker, or "E"]
    (1, 3, False): [{0, 1, 2}],  # the only worker does everything
    (2, 3, False): ["E", {0, 1, 2}],
    (2, 3, True): ["E", {0}],
    (4, 3, False): ["E", {0}, {1}, {2}],
    (5, 3, False): ["E", {0}, {1}, {2}, "E"],  # index 4 starts a new round with the ensemble task
    (7, 3, False): ["E", {0}, {1}, {2}, "E", {0, 2}, {1}],  # partial round: 2 seats share 3 subnetworks
    (7, 3, True): ["E", {0}, {1}, {2}, "E", {0}, {1}],
    (6, 5, False): ["E", {0}, {1}, {2}, {3}, {4}],
    (8, 5, False): ["E", {0}, {1}, {2}, {3}, {4}, "E", {0, 1, 2, 3, 4}],
}


@pytest.mark.parametrize("case", sorted(HAND_TABLES))
def test_round_robin_hand_written_tables(case):
    num_workers, num_subnetworks, drop_remainder = case
    expected = [
        (True, frozenset(range(num_subnetworks)), num_workers == 1) if row == "E" else
        (num_workers == 1, frozenset(row), True)
        for row in HAND_TABLES[case]
    ]
    assert observed(RoundRobinStrategy, num_workers, num_subnetworks, drop_remainder=drop_remainder) == expected


def trained_by_someone(num_workers: int, num_subnetworks: int, drop_remainder: bool) -> set[int]:
    rows = observed(RoundRobinStrategy, num_workers, num_subnetworks, drop_remainder=drop_remainder)
    return {i for _, built, trains in rows if trains for i in built}


@given(num_workers=st.integers(2, 40), num_subnetworks=st.integers(1, 12))
def test_without_drop_remainder_every_subnetwork_is_trained(num_workers, num_subnetworks):
    assert trained_by_someone(num_workers, num_subnetworks, False) == set(range(num_subnetworks))


@given(num_workers=st.integers(1, 40), num_subnetworks=st.integers(1, 12))
def test_with_drop_remainder_exactly_the_reported_subnetworks_are_dropped(num_workers, num_subnetworks):
    dropped = set(round_robin.dropped_subnetworks(num_workers, num_subnetworks, True))
    assert trained_by_someone(num_workers, num_subnetworks, True) == set(range(num_subnetworks)) - dropped
    assert round_robin.dropped_subnetworks(num_workers, num_subnetworks, False) == range(0)


@given(num_workers=st.integers(2, 40), num_subnetworks=st.integers(2, 12), drop_remainder=st.booleans())
def test_an_ensemble_worker_never_trains_and_a_subnetwork_worker_always_does(
    num_workers, num_subnetworks, drop_remainder
):
    for builds_ensemble, built, trains in observed(
        RoundRobinStrategy, num_workers, num_subnetworks, drop_remainder=drop_remainder
    ):
        assert trains != builds_ensemble
        assert built  # a subnetwork worker always has at least one subnetwork here
        if drop_remainder and trains:
            assert len(built) == 1
