"""The closure queue's error semantics, in one process (TensorFlow's rules)."""

import threading

import pytest

from unison._ps.chief.closure_queue import Closure, ClosureQueue
from unison.errors import FunctionCancelledError, ParameterServerError


def _closure(name="fn"):
    return Closure(b"", name)


def test_first_error_raised_once_queued_cancelled_then_cleared():
    queue = ClosureQueue()
    a, b, c = _closure("a"), _closure("b"), _closure("c")
    for closure in (a, b, c):
        queue.put(closure)
    taken = queue.get()
    assert taken is a
    queue.failed(a, ValueError("boom"))
    with pytest.raises(ValueError, match="boom"):
        queue.wait()
    queue.wait()  # cleared: raised once
    assert queue.done()
    with pytest.raises(ValueError, match="boom"):
        a.result.fetch()
    for cancelled in (b, c):
        with pytest.raises(FunctionCancelledError, match=f"{cancelled.fn_name!r} was cancelled.*reschedule"):
            cancelled.result.fetch()


def test_error_is_raised_by_the_next_schedule_or_done():
    queue = ClosureQueue()
    queue.put(_closure())
    queue.failed(queue.get(), KeyError("k"))
    with pytest.raises(KeyError):
        queue.put(_closure())
    queue.put(_closure())  # cleared
    queue.failed(queue.get(), TypeError("t"))
    with pytest.raises(TypeError):
        queue.done()
    assert queue.done()


def test_lost_worker_closure_runs_again_first():
    queue = ClosureQueue()
    a, b = _closure("a"), _closure("b")
    queue.put(a)
    queue.put(b)
    queue.put_back(queue.get())
    assert queue.get() is a and a.attempts == 1


def test_join_waits_for_inflight_closures():
    queue = ClosureQueue()
    queue.put(_closure())
    closure = queue.get()
    timer = threading.Timer(0.2, queue.finished, args=(closure, 7))
    timer.start()
    queue.wait()
    assert closure.result.fetch() == 7
    timer.join()


def test_fatal_error_stays_and_fails_queued():
    queue = ClosureQueue()
    queued = _closure()
    queue.put(queued)
    queue.fail_all(ParameterServerError("ps:1 is unavailable"))
    for _ in range(2):
        with pytest.raises(ParameterServerError, match="ps:1"):
            queue.wait()
    with pytest.raises(ParameterServerError, match="ps:1"):
        queued.result.fetch()
