"""A ps task's session threads run under SCHED_BATCH (their wakeups do not preempt a worker on the
host); the rest of the process keeps its policy, and ``UNISON_PS_SCHED_BATCH=0`` keeps the default."""

from __future__ import annotations

import os
import threading

import pytest
import torch

import unison
from unison._coordinator.channel import generate_authkey
from unison._ps.task import scheduling
from unison._ps.wire import protocol as wire
from unison._ps.wire.client import PSClient

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling policies")


def _session_policies(monkeypatch, value: str | None) -> tuple[list[int], int]:
    if value is not None:
        monkeypatch.setenv("UNISON_PS_SCHED_BATCH", value)
    key = generate_authkey()
    server = unison.Server({"ps": ["127.0.0.1:1"]}, "ps", 0, authkey=key, bind_address="127.0.0.1:0")
    client = PSClient([server.address], key, timeout=10, reply_timeout=10)
    try:
        client.write(wire.Create, [(0, "w")], [torch.zeros(2)])  # opens a session
        sessions = list(server._sessions)
        return [os.sched_getscheduler(thread.native_id) for thread in sessions], os.sched_getscheduler(0)
    finally:
        client.close()
        server.stop()


@pytest.mark.timeout(60)
def test_a_session_thread_runs_under_sched_batch_and_the_process_does_not(monkeypatch):
    sessions, caller = _session_policies(monkeypatch, None)
    assert sessions == [os.SCHED_BATCH]
    assert caller == os.SCHED_OTHER  # the thread that started the server (and the rest) as they were


@pytest.mark.timeout(60)
def test_unison_ps_sched_batch_0_keeps_the_default_policy(monkeypatch):
    sessions, _ = _session_policies(monkeypatch, "0")
    assert sessions == [os.SCHED_OTHER]


def test_a_refusal_leaves_the_thread_as_it_was(monkeypatch):
    def refuse(*args):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_setscheduler", refuse)
    answers = []
    thread = threading.Thread(target=lambda: answers.append((scheduling.serve_at_batch_priority(),
                                                             os.sched_getscheduler(0))))
    thread.start()
    thread.join(10)
    assert answers == [(False, os.SCHED_OTHER)]
