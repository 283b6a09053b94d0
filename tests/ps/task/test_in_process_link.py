"""A ps task served in the requester's own process (``unison launch --ps-in-workers``): its link
applies each request where it is sent, with a socket session's semantics, and no socket."""

from __future__ import annotations

import threading

import pytest
import torch

import unison
from unison._coordinator.channel import generate_authkey
from unison._embeddings.optim.row_optimizers import RowSGD
from unison._embeddings.tables.initializers import Uniform
from unison._embeddings.tables.table import TableConfig
from unison._launch.procs import reserve_ports
from unison._ps.task.in_process_link import InProcessLink
from unison._ps.task.parameter_store import ParameterStore
from unison._ps.wire import in_process
from unison._ps.wire import protocol as wire
from unison._ps.wire.client import PSClient
from unison._ps.wire.links import open_link
from unison._ps.worker.remote_table import RemoteTable

CONFIG = TableConfig(4, torch.float32, Uniform(-0.1, 0.1), 0, None)


def test_requests_are_applied_as_they_are_sent_and_answered_at_recv():
    store = ParameterStore()
    link = InProcessLink(store, "ps:0")
    link.send(wire.TableCreate("t", CONFIG))
    assert isinstance(link.recv()[0], wire.Ok)
    ids = torch.tensor([5, 9])
    header, (rows,) = link.request(wire.TableRows("t", True), [ids, torch.ones_like(ids)])
    assert isinstance(header, wire.Ok) and rows.shape == (2, 4)
    assert store.tables.stats()["t"][0] == 2  # made on the store itself, at send
    link.send(wire.TablePush("t", RowSGD(lr=1.0), None), [ids, torch.ones(2, 4)])  # no answer when it succeeds
    assert link._answer is None
    _, (after,) = link.request(wire.TableRows("t", False), [ids, torch.ones_like(ids)])
    torch.testing.assert_close(after, rows - 1.0)


def test_a_dense_pull_gets_a_tensor_of_its_own():
    # A socket session reuses its pull buffers (each is sent before the next request); an
    # in-process caller keeps the tensor, so the next pull must not write into it.
    store = ParameterStore()
    store.create("w", torch.zeros(3))
    link = InProcessLink(store, "ps:0")
    _, (first,) = link.request(wire.Pull(("w",)))
    store.assign("w", torch.ones(3))
    _, (second,) = link.request(wire.Pull(("w",)))
    assert torch.equal(first, torch.zeros(3)) and torch.equal(second, torch.ones(3))
    into = torch.empty(3)
    _, (got,) = link.request(wire.Pull(("w",)), into=[into])
    assert got is into and torch.equal(into, torch.ones(3))


def test_a_bad_request_is_answered_with_its_error_and_a_closed_link_reads_as_a_lost_peer():
    link = InProcessLink(ParameterStore(), "ps:0")
    header, _ = link.request(wire.TableRows("missing", True), [torch.tensor([1]), torch.tensor([1])])
    assert isinstance(header, wire.Failed) and "no dynamic table 'missing'" in str(header.error)
    with pytest.raises(EOFError, match="no answer is waiting"):
        link.recv()
    link.close()
    with pytest.raises(EOFError, match="ps:0 is no longer served in this process"):
        link.send(wire.Ping())


@pytest.mark.timeout(60)
def test_a_server_in_process_serves_this_process_without_a_socket_and_others_over_it():
    key = generate_authkey()
    address = f"127.0.0.1:{reserve_ports(1)[0]}"
    server = unison.Server({"ps": [address]}, "ps", 0, authkey=key, in_process=True)
    client = PSClient([address], key, timeout=10, reply_timeout=10)
    try:
        table = RemoteTable("t", 1, CONFIG, lambda: client)
        table.create()
        rows = table.lookup(torch.tensor([1, 2, 3]))
        assert isinstance(client._links[0], InProcessLink)
        assert server._ps_sessions_opened == 0  # no session, no socket
        # another process's worker reaches the same ps task over its socket, and sees the same rows
        link = open_link(address, key, "ps", "ps:0", timeout=10)
        try:
            header, (theirs,) = link.request(wire.TableRows("t", False), [torch.tensor([1, 2, 3]), torch.ones(3)])
            assert isinstance(header, wire.Ok) and torch.equal(theirs, rows)
        finally:
            link.close()
        assert server.wait_for_ps_sessions(1, connect_timeout=10)  # came and went
    finally:
        client.close()
        server.stop()
    assert in_process.opener_for(address) is None  # stopped: this process connects like any other


@pytest.mark.timeout(30)
def test_waiting_for_peers_gives_up_on_one_that_never_comes():
    address = f"127.0.0.1:{reserve_ports(1)[0]}"
    server = unison.Server({"ps": [address]}, "ps", 0, authkey=generate_authkey(), in_process=True)
    try:
        assert not server.wait_for_ps_sessions(1, connect_timeout=0.2)
    finally:
        server.stop()


@pytest.mark.timeout(60)
def test_the_client_applies_in_process_after_the_other_ps_tasks_replied():
    # An in-process request is applied as it is sent. Sent first, it would keep the other ps
    # tasks idle while it runs; applied before their replies, it would hold its shard's lock
    # while the other workers' requests to that shard wait. Pushes (no reply) go last too.
    events: list[str] = []

    class _Recording:
        def __init__(self, name, in_process_link):
            self.name, self.in_process = name, in_process_link
            self.lock = threading.Lock()

        def send(self, header, tensors=()):
            events.append(f"send {self.name}")

        def recv(self, into=None, timeout=None, reuse=False):
            events.append(f"recv {self.name}")
            return wire.Ok(), []

    client = PSClient(["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"], generate_authkey())
    client._links = {0: _Recording("in-process", True), 1: _Recording("socket-1", False),
                     2: _Recording("socket-2", False)}
    client.exchange({i: (wire.Ping(), (), None) for i in range(3)})
    assert events == ["send socket-1", "send socket-2", "recv socket-1", "recv socket-2", "send in-process",
                      "recv in-process"]
    events.clear()
    push = wire.TablePush("t", RowSGD(lr=1.0), None)
    client.exchange({i: (push, (), None) for i in range(3)}, wait=False)
    assert events == ["send socket-1", "send socket-2", "send in-process"]
