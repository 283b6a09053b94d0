"""Contexts and scopes: get_strategy, has_strategy, replica / cross-replica context."""

from __future__ import annotations

import pytest
import torch

import unison
from unison import (
    get_cross_replica_context,
    get_replica_context,
    get_strategy,
    has_strategy,
    in_cross_replica_context,
)

pytestmark = pytest.mark.timeout(30)  # replicas are threads: a hung rendezvous fails the test


def test_default_strategy_outside_any_scope():
    strategy = get_strategy()
    assert not has_strategy()
    assert strategy is get_strategy()  # one default instance
    assert strategy.num_replicas_in_sync == 1
    assert strategy.extended.worker_devices == ("cpu:0",)
    assert not in_cross_replica_context()
    assert get_cross_replica_context() is None
    context = get_replica_context()
    assert context is not None  # the default replica context
    assert context.replica_id_in_sync_group == 0
    assert context.num_replicas_in_sync == 1
    assert context.strategy is strategy


def test_scope_is_cross_replica_context(mirrored2):
    with mirrored2.scope() as entered:
        assert entered is mirrored2
        assert get_strategy() is mirrored2
        assert has_strategy()
        assert in_cross_replica_context()
        assert get_replica_context() is None
        assert get_cross_replica_context() is mirrored2
    assert not has_strategy()
    assert get_strategy() is not mirrored2


def test_replica_context_inside_run(mirrored2, thread_baseline):
    def fn():
        ctx = get_replica_context()
        return (
            ctx.replica_id_in_sync_group,
            ctx.num_replicas_in_sync,
            ctx.strategy is mirrored2,
            get_strategy() is mirrored2,
            has_strategy(),
            in_cross_replica_context(),
            get_cross_replica_context(),
        )

    replica_id, *rest = mirrored2.run(fn)
    # regroup: values that differ become PerReplica, the very same object stays itself
    assert isinstance(replica_id, unison.PerReplica)
    assert mirrored2.experimental_local_results(replica_id) == (0, 1)
    assert rest == [2, True, True, True, False, None]


def test_run_inside_scope_and_outside_scope_agree(mirrored2):
    outside = mirrored2.run(lambda: get_replica_context().replica_id_in_sync_group)
    with mirrored2.scope():
        inside = mirrored2.run(lambda: get_replica_context().replica_id_in_sync_group)
        assert in_cross_replica_context()  # back to cross-replica after run
    assert mirrored2.experimental_local_results(outside) == (0, 1)
    assert mirrored2.experimental_local_results(inside) == (0, 1)


def test_merge_fn_runs_in_cross_replica_context(mirrored2):
    seen = []

    def merge_fn(strategy):
        seen.append((strategy is mirrored2, in_cross_replica_context(), get_replica_context(),
                     get_strategy() is strategy))
        return 7

    out = mirrored2.run(lambda: get_replica_context().merge_call(merge_fn))
    assert seen == [(True, True, None, True)]  # once, not once per replica
    assert out == 7  # the same object on every replica comes back as itself, as in TF's regroup


def test_merge_call_regroups_args_and_hands_back_components(mirrored2):
    def merge_fn(strategy, value, same):
        assert isinstance(value, unison.PerReplica)  # differing args are regrouped
        assert same == "same"  # equal objects are passed as they are
        return strategy.extended.reduce_to("sum", value, value), value

    def fn():
        i = get_replica_context().replica_id_in_sync_group
        mine = torch.tensor(float(i + 1))
        total, back = get_replica_context().merge_call(merge_fn, args=(mine,), kwargs={"same": "same"})
        return total, back is mine, total.data_ptr() != mine.data_ptr()

    total, got_own, fresh = mirrored2.run(fn)
    assert [t.item() for t in mirrored2.experimental_local_results(total)] == [3.0, 3.0]
    assert got_own is True and fresh is True  # each replica gets its own component back


def test_one_device_run_is_inline(one_device):
    import threading

    def fn():
        return threading.current_thread() is threading.main_thread(), get_replica_context().replica_id_in_sync_group

    assert one_device.run(fn) == (True, 0)


def test_one_device_run_takes_the_same_context_on_its_short_path_and_its_general_one():
    """A step with plain tensor arguments outside any scope (``OneDeviceStrategy.run``'s short
    path) runs as one with keyword or PerReplica arguments, or inside the scope (the general
    path): in the replica context, its result returned, the context gone afterwards, even
    when the step raises."""
    strategy = unison.OneDeviceStrategy("cpu:0")

    def step(x, y=None):
        context = get_replica_context()
        assert context is not None and not in_cross_replica_context() and get_strategy() is strategy
        if y is None:
            raise RuntimeError("a failed step")
        return x + y, context.replica_id_in_sync_group

    x, y = torch.ones(2), torch.full((2,), 2.0)
    calls = [lambda: strategy.run(step, args=(x, y)), lambda: strategy.run(step, args=(x,), kwargs={"y": y}),
             lambda: strategy.run(step, args=(unison.PerReplica([x]), y))]
    for call in calls:
        total, replica = call()
        assert torch.equal(total, torch.full((2,), 3.0)) and replica == 0
        assert not has_strategy()
        with strategy.scope():
            total, replica = call()
            assert torch.equal(total, torch.full((2,), 3.0)) and replica == 0
            assert in_cross_replica_context()
    with pytest.raises(RuntimeError, match="a failed step"):
        strategy.run(step, args=(x,))
    assert not has_strategy() and get_replica_context() is not None  # the default strategy's again
    with pytest.raises(ValueError, match="strategies cannot be nested or mixed"):
        with unison.MirroredStrategy(["cpu:0", "cpu:1"]).scope():
            strategy.run(step, args=(x, y))


def test_same_strategy_scope_reenters(mirrored2):
    with mirrored2.scope():
        with mirrored2.scope():
            assert get_strategy() is mirrored2
            assert in_cross_replica_context()
        assert get_strategy() is mirrored2
    assert not has_strategy()


@pytest.mark.parametrize(
    "make_other",
    [
        lambda: unison.MirroredStrategy(["cpu:0", "cpu:1"]),
        lambda: unison.OneDeviceStrategy("cpu:0"),
        lambda: unison.CentralStorageStrategy(["cpu:0", "cpu:1"]),
    ],
    ids=["mirrored", "one_device", "central_storage"],
)
def test_nested_scope_of_another_strategy_raises(mirrored2, make_other):
    other = make_other()
    with mirrored2.scope():
        with pytest.raises(ValueError, match=r"cannot enter the scope of \w+Strategy inside the scope of a different "
                                             r"strategy \(MirroredStrategy\)"):
            with other.scope():
                pass  # pragma: no cover
        # the failed attempt left the outer scope intact
        assert get_strategy() is mirrored2
    assert not has_strategy()


def test_scope_state_is_per_thread(mirrored2):
    import threading

    seen = []
    with mirrored2.scope():
        thread = threading.Thread(target=lambda: seen.append(has_strategy()))
        thread.start()
        thread.join()
    assert seen == [False]


def test_default_strategy_run_and_reduce():
    strategy = get_strategy()
    out = strategy.run(lambda x: x * 2, args=(torch.tensor(3.0),))
    assert out.item() == 6.0
    assert strategy.reduce("sum", out).item() == 6.0
    assert strategy.experimental_local_results(out) == (out,)
