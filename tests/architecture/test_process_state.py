"""Per-thread flags and the registry of live threads live on ``unison._state.ProcessState``.

A module global that holds per-thread state (a ``threading.local``) or tracks live
threads (a ``WeakSet``) is process state that other modules change; it belongs to
``ProcessState``, whose default instance is ``STATE`` and which tests may build afresh.
Object-keyed side tables (``WeakKeyDictionary``: a strategy's coordinator, a
parameter's synchroniser) belong to the module of their concept and are not checked.
"""

from __future__ import annotations

import importlib
import pkgutil
import threading
import weakref

import pytest

import unison
from unison._state import STATE, OwnComponentWrites, ProcessState

pytestmark = pytest.mark.timeout(60)

_PROCESS_STATE_KINDS = (threading.local, weakref.WeakSet)


def _module_level_process_state() -> list[str]:
    found = []
    for info in pkgutil.walk_packages(unison.__path__, "unison."):
        if "_testing" in info.name or info.name.endswith("__main__") or info.name == "unison._state":
            continue
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if isinstance(value, _PROCESS_STATE_KINDS):
                found.append(f"{info.name}.{name}: {type(value).__name__}")
    return found


def test_no_module_but_state_holds_per_thread_flags_or_live_threads():
    found = _module_level_process_state()
    assert not found, "process state kept as module globals (make them ProcessState attributes):\n" + "\n".join(found)


def test_own_component_writes_is_per_thread_and_per_state():
    state, other = ProcessState(), ProcessState()
    assert isinstance(STATE.own_component_writes, OwnComponentWrites)
    state.own_component_writes.begin()
    seen_elsewhere: list[bool] = []
    thread = threading.Thread(target=lambda: seen_elsewhere.append(state.own_component_writes.active))
    thread.start()
    thread.join(10)
    assert (state.own_component_writes.active, seen_elsewhere,
            other.own_component_writes.active) == (True, [False], False)
    state.own_component_writes.end()
    assert not state.own_component_writes.active


def test_busy_replica_threads_drop_finished_threads():
    state = ProcessState()
    thread = threading.Thread(target=lambda: None)
    state.busy_replica_threads.add(thread)
    assert thread in state.busy_replica_threads and thread not in STATE.busy_replica_threads
    thread.start()
    thread.join(10)
    del thread
    assert len(state.busy_replica_threads) == 0


def test_context_stack_is_per_thread_and_per_state_from_a_threads_first_access():
    state, other = ProcessState(), ProcessState()
    state.stack().append("entry")
    seen_elsewhere: list[list] = []
    thread = threading.Thread(target=lambda: seen_elsewhere.append(list(state.per_thread.stack)))
    thread.start()
    thread.join(10)
    assert (state.per_thread.stack, seen_elsewhere, other.stack()) == (["entry"], [[]], [])
    assert state.stack() is state.per_thread.stack  # the hot path's attribute and the method: one list
