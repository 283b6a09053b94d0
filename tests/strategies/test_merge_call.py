"""merge_call under threaded replicas: results, errors reaching the caller, no hang, no thread left."""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch

import unison
from unison import get_replica_context
from unison._strategies.replicas import replica_thread_is_idle
from unison.errors import MergeCallError, UnisonError

pytestmark = pytest.mark.timeout(20)  # a hung rendezvous fails the test instead of CI


def _rid() -> int:
    return get_replica_context().replica_id_in_sync_group


def test_merge_call_passes_args_kwargs_and_result(mirrored2, thread_baseline):
    def merge_fn(strategy, value, *, scale):
        return strategy.reduce("sum", value) * scale

    def fn():
        return get_replica_context().merge_call(merge_fn, args=(torch.tensor(float(_rid() + 1)),),
                                                kwargs={"scale": 2.0})

    out = mirrored2.run(fn)
    assert out.item() == 6.0  # the same result object goes to every replica


def test_several_merge_calls_in_one_run(mirrored2, thread_baseline):
    order = []

    def fn():
        total = 0.0
        for k in range(5):
            total += get_replica_context().merge_call(lambda s, k=k: (order.append(k), k)[1])
        return total

    out = mirrored2.run(fn)
    assert mirrored2.experimental_local_results(out) == (10.0, 10.0)
    assert order == [0, 1, 2, 3, 4]  # each merge ran once, in order


def test_exception_in_one_replica_reaches_caller(mirrored2, thread_baseline):
    class Boom(Exception):
        pass

    def fn():
        if _rid() == 1:
            raise Boom("replica 1 failed")
        get_replica_context().merge_call(lambda s: None)  # replica 0 waits here
        return "unreachable"

    with pytest.raises(Boom, match="replica 1 failed"):
        mirrored2.run(fn)


@pytest.mark.parametrize("replica_1", ["raises", "returns"])
def test_a_merge_entered_after_every_other_replica_settled_does_not_wait(mirrored2, thread_baseline, replica_1):
    """Replica 0 runs in the caller's thread: when it reaches a merge after replica 1 has
    already failed or returned, no other thread is left to decide for it."""

    def fn():
        if _rid() == 1:
            if replica_1 == "raises":
                raise ValueError("replica 1 failed")
            return 1
        time.sleep(0.5)  # replica 1 settles first
        get_replica_context().merge_call(lambda s: None)
        return 0

    expected = (ValueError, "replica 1 failed") if replica_1 == "raises" else (MergeCallError, "returned without")
    with pytest.raises(expected[0], match=expected[1]):
        mirrored2.run(fn)


def test_exception_after_merge_reaches_caller(mirrored2, thread_baseline):
    def fn():
        get_replica_context().merge_call(lambda s: None)
        if _rid() == 0:
            raise KeyError("after the merge")
        get_replica_context().merge_call(lambda s: None)

    with pytest.raises(KeyError, match="after the merge"):
        mirrored2.run(fn)


def test_exception_in_every_replica_raises_one(mirrored2, thread_baseline):
    def fn():
        raise ValueError(f"replica {_rid()}")

    with pytest.raises(ValueError, match=r"replica [01]"):
        mirrored2.run(fn)


def test_exception_in_merge_fn_reaches_caller(mirrored2, thread_baseline):
    def fn():
        get_replica_context().merge_call(lambda s: 1 / 0)
        return "unreachable"

    with pytest.raises(ZeroDivisionError, match="division by zero"):
        mirrored2.run(fn)


def test_replica_skipping_merge_call_raises_merge_call_error(mirrored2, thread_baseline):
    def fn():
        if _rid() == 0:
            get_replica_context().merge_call(lambda s: None)
        return 1

    with pytest.raises(MergeCallError, match=r"replicas \[0\] called merge_call but replicas \[1\] returned without "
                                             r"calling it: every replica must make the same merge_call"):
        mirrored2.run(fn)


def test_replica_with_extra_merge_call_raises_merge_call_error(mirrored2, thread_baseline):
    def fn():
        get_replica_context().merge_call(lambda s: None)
        if _rid() == 1:
            get_replica_context().all_reduce("sum", torch.ones(1))

    with pytest.raises(MergeCallError, match=r"replicas \[1\] called merge_call but replicas \[0\] returned"):
        mirrored2.run(fn)


def test_one_of_three_replicas_skipping_merge_call():
    strategy = unison.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"])

    def fn():
        if _rid() != 2:
            get_replica_context().merge_call(lambda s: None)

    with pytest.raises(MergeCallError, match=r"replicas \[0, 1\] called merge_call but replicas \[2\] returned"):
        strategy.run(fn)
    # every replica thread goes back to waiting for the next step, none stays stuck in merge_call
    deadline = time.monotonic() + 3.0
    while not all(replica_thread_is_idle(t) for t in threading.enumerate() if t.name.startswith("unison-replica-")):
        assert time.monotonic() < deadline, "a replica thread is still busy after the failed step"
        time.sleep(0.01)
    assert strategy.run(lambda: unison.get_replica_context().replica_id_in_sync_group).values == (0, 1, 2)


def test_merge_call_error_is_a_runtime_unison_error():
    assert issubclass(MergeCallError, UnisonError)
    assert issubclass(MergeCallError, RuntimeError)


def test_strategy_usable_after_failures(mirrored2, thread_baseline):
    with pytest.raises(ZeroDivisionError):
        mirrored2.run(lambda: get_replica_context().merge_call(lambda s: 1 / 0))
    with pytest.raises(MergeCallError):
        mirrored2.run(lambda: get_replica_context().merge_call(lambda s: None) if _rid() else None)
    out = mirrored2.run(lambda: get_replica_context().all_reduce("sum", torch.tensor(float(_rid()))))
    assert [t.item() for t in mirrored2.experimental_local_results(out)] == [1.0, 1.0]


def test_waiting_replica_is_unwound_with_finally(mirrored2, thread_baseline):
    cleaned = []

    def fn():
        try:
            if _rid() == 0:
                raise RuntimeError("stop")
            get_replica_context().merge_call(lambda s: None)
        finally:
            cleaned.append(_rid())

    with pytest.raises(RuntimeError, match="stop"):
        mirrored2.run(fn)
    assert sorted(cleaned) == [0, 1]  # the waiting replica ran its finally block


def test_replica_threads_serve_every_step_and_stop_with_their_strategy(thread_baseline):
    """Replica threads are started once and kept between steps (a thread start per step cost more
    than a small step); they end when their strategy is gone. CPU replica 0 runs in the caller's
    thread (one thread hand-off fewer per step)."""
    strategy = unison.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"])
    first = strategy.experimental_local_results(strategy.run(threading.current_thread))
    second = strategy.experimental_local_results(strategy.run(threading.current_thread))
    assert first[0] is threading.current_thread()
    assert [t.name for t in first[1:]] == ["unison-replica-1", "unison-replica-2"]
    assert first == second and all(t.is_alive() for t in first)
    threads = first[1:]
    del strategy, first, second
    gc.collect()
    for thread in threads:
        thread.join(timeout=5)
        assert not thread.is_alive()


def test_replicas_run_with_callers_grad_mode(mirrored2):
    with torch.no_grad():
        modes = mirrored2.run(torch.is_grad_enabled)
    assert modes is False
    assert mirrored2.run(torch.is_grad_enabled) is True


def test_run_passes_per_replica_args_and_kwargs(mirrored2):
    x = unison.PerReplica([torch.tensor(1.0), torch.tensor(2.0)])
    out = mirrored2.run(lambda a, b, *, c: a * b + c, args=(x, 10.0), kwargs={"c": x})
    assert [t.item() for t in mirrored2.experimental_local_results(out)] == [11.0, 22.0]


def test_run_with_wrong_number_of_components_raises(mirrored2):
    x = unison.PerReplica([torch.tensor(1.0)])
    with pytest.raises(ValueError, match=r"PerReplica has 1 components but replica 1 asked for one"):
        mirrored2.run(lambda a: a, args=(x,))


def test_replicas_returning_different_structures_raise(mirrored2):
    with pytest.raises(ValueError, match=r"replicas returned different structures"):
        mirrored2.run(lambda: (1,) if _rid() == 0 else [1, 2])


def test_merge_call_on_one_device_is_inline(one_device):
    def merge_fn(strategy, value):
        assert unison.in_cross_replica_context()
        return value + 1

    assert one_device.run(lambda: get_replica_context().merge_call(merge_fn, args=(1,))) == 2
    with pytest.raises(ZeroDivisionError):
        one_device.run(lambda: get_replica_context().merge_call(lambda s: 1 / 0))
    assert not unison.has_strategy()  # the context stack unwound


def test_replicas_run_with_callers_autocast(mirrored2):
    """Replica 0 runs in the caller's thread, so it sees the caller's autocast; the other
    replica threads enter the same, and every replica computes alike."""
    def modes():
        return _rid(), torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")

    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = mirrored2.run(modes)
    assert out[1:] == (True, torch.bfloat16)
    assert mirrored2.experimental_local_results(out[0]) == (0, 1)
    assert mirrored2.run(modes)[1] is False
