"""The ps session's handshake with a real ps server: the same protocol version is served, another is
refused at once with both versions named, and a malformed request gets an error naming it."""

from __future__ import annotations

import os
import socket
import sys
import threading

import pytest
import torch

import unison
from unison._coordinator.channel import connect, generate_authkey
from unison._ps import task_server
from unison._ps.wire import protocol as wire
from unison._ps.wire.client import PSClient
from unison._ps.wire.links import open_link
from unison.errors import ParameterServerError


@pytest.fixture()
def ps_server():
    key = generate_authkey()
    server = unison.Server({"ps": ["127.0.0.1:1"]}, "ps", 0, authkey=key, bind_address="127.0.0.1:0")
    try:
        yield server.address, key
    finally:
        server.stop()


def test_a_peer_of_the_same_version_is_served(ps_server):
    address, key = ps_server
    client = PSClient([address], key, timeout=10, reply_timeout=10)
    try:
        client.write(wire.Create, [(0, "w")], [torch.arange(4.0)])
        assert torch.equal(client.read([(0, "w")])[0], torch.arange(4.0))
    finally:
        client.close()


@pytest.mark.parametrize("opening", [("ps",), ("ps", wire.Hello(wire.PROTOCOL_VERSION + 1)), ("ps", "hello")])
def test_another_version_is_refused_at_the_handshake(ps_server, opening):
    address, key = ps_server
    channel = connect(address, key, 10)
    try:
        channel.send(opening)
        answer = channel.recv()
        assert isinstance(answer, wire.Refused), answer
        assert f"ps protocol version {wire.PROTOCOL_VERSION}" in answer.reason
        with pytest.raises(EOFError):  # and the session is closed: no request gets further
            channel.recv()
    finally:
        channel.close()


def test_open_link_names_a_refusal(ps_server, monkeypatch):
    address, key = ps_server
    monkeypatch.setattr("unison._ps.wire.links.PROTOCOL_VERSION", wire.PROTOCOL_VERSION + 1)
    with pytest.raises(ParameterServerError, match=rf"ps:0 at {address} refused the ps session: .*version "
                                                   rf"{wire.PROTOCOL_VERSION}, the peer {wire.PROTOCOL_VERSION + 1}"):
        open_link(address, key, "ps", "ps:0", 10)


def test_a_malformed_request_gets_an_error_naming_it(ps_server):
    address, key = ps_server
    link = open_link(address, key, "ps", "ps:0", 10)
    try:
        header, _ = link.request(("pull", ["w"]))
        assert isinstance(header, wire.Failed)
        assert isinstance(header.error, wire.ProtocolError) and "malformed ps request 'pull'" in str(header.error)
        assert isinstance(link.request(wire.Ping())[0], wire.Ok)  # the session goes on
    finally:
        link.close()


def test_a_malformed_worker_request_gets_an_error_naming_it():
    from unison._ps.task_server import Server

    reply = Server._handle(None, None, {}, ("run", b"payload"))  # an old positional request  # type: ignore[arg-type]
    assert isinstance(reply, wire.FunctionFailed) and not reply.lost_ps
    assert isinstance(reply.error, wire.ProtocolError)
    assert "malformed worker request 'tuple'" in str(reply.error) and "RunFunction" in str(reply.error)


def test_a_ps_task_never_reached_is_named_unreachable_not_lost(free_port):
    address = f"127.0.0.1:{free_port}"  # nothing listens there
    client = PSClient([address], generate_authkey(), timeout=0.5, reply_timeout=5)
    try:
        with pytest.raises(ParameterServerError, match=r"could not be reached") as caught:
            client.read([(0, "w")])
    finally:
        client.close()
    message = str(caught.value)
    assert f"ps:0 at {address}" in message and "no variables were lost" in message, message
    assert "variables are lost" not in message and "restore the last checkpoint" not in message, message


def test_another_version_through_the_client_says_only_how_to_fix_it(ps_server, monkeypatch):
    address, key = ps_server
    monkeypatch.setattr("unison._ps.wire.links.PROTOCOL_VERSION", wire.PROTOCOL_VERSION + 1)
    client = PSClient([address], key, timeout=10, reply_timeout=10)
    try:
        with pytest.raises(ParameterServerError, match=r"refused the ps session") as caught:
            client.read([(0, "w")])
    finally:
        client.close()
    message = str(caught.value)
    assert "run the same unison version on every task" in message, message
    assert "variables are lost" not in message and "restore the last checkpoint" not in message, message


def test_a_ps_task_gone_after_it_was_reached_is_lost():
    key = generate_authkey()
    server = unison.Server({"ps": ["127.0.0.1:1"]}, "ps", 0, authkey=key, bind_address="127.0.0.1:0")
    client = PSClient([server.address], key, timeout=0.5, reply_timeout=5)
    try:
        client.write(wire.Create, [(0, "w")], [torch.arange(4.0)])
        server.stop()
        with pytest.raises(ParameterServerError, match=r"its variables are lost"):
            for _ in range(3):  # the first request after the stop may still find the link open
                client.read([(0, "w")])
                client._drop(0)
    finally:
        client.close()
        server.stop()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract Unix sockets are Linux's")
def test_a_link_to_a_ps_task_on_this_host_skips_tcp(ps_server):
    """A worker's link to a ps task on its host goes over the listener's same-host Unix socket
    (no TCP/IP stack for the rows and gradients: benchmarks/RESULTS.md), and serves requests."""
    address, key = ps_server
    link = open_link(address, key, "ps", "ps:0", 10)
    try:
        assert link._in_socket.family == link._out_socket.family == socket.AF_UNIX
        assert isinstance(link.request(wire.Ping())[0], wire.Ok)
    finally:
        link.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract Unix sockets are Linux's")
@pytest.mark.timeout(60)
def test_a_same_host_link_that_asks_takes_its_replies_on_a_socket_of_their_own(ps_server):
    """With ``replies_apart`` (a ParameterServerStrategy worker's client) the ps task answers on a
    socket the worker handed over: a ps task asleep for the next request is not woken as its
    worker reads its reply (benchmarks/RESULTS.md); without it, one socket carries both ways."""
    address, key = ps_server
    client = PSClient([address], key, timeout=10, reply_timeout=10, replies_apart=True)
    plain = open_link(address, key, "ps", "ps:0", 10)
    try:
        client.write(wire.Create, [(0, "w")], [torch.arange(70_000.0)])  # a reply larger than one write
        for _ in range(3):
            assert torch.equal(client.read([(0, "w")])[0], torch.arange(70_000.0))
        link = client._links[0]
        assert os.fstat(link._in_socket.fileno()).st_ino != os.fstat(link._out_socket.fileno()).st_ino
        assert os.fstat(plain._in_socket.fileno()).st_ino == os.fstat(plain._out_socket.fileno()).st_ino
        assert link._in_socket.family == link._out_socket.family == socket.AF_UNIX
        assert isinstance(plain.request(wire.Ping())[0], wire.Ok)
    finally:
        client.close()
        plain.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract Unix sockets are Linux's")
@pytest.mark.timeout(60)
def test_a_worker_waiting_on_its_reply_socket_sees_the_session_end():
    """When the ps task ends a session (``Server.join`` once the coordinator is done), a worker
    waiting for a reply on the socket it handed over sees the end, not a silence."""
    key = generate_authkey()
    server = unison.Server({"ps": ["127.0.0.1:1"]}, "ps", 0, authkey=key, bind_address="127.0.0.1:0")
    link = open_link(server.address, key, "ps", "ps:0", 10, replies_apart=True)
    try:
        assert isinstance(link.request(wire.Ping())[0], wire.Ok)
        server._close_sessions()  # what join does
        with pytest.raises((EOFError, OSError)) as ended:
            link.recv(timeout=20)
        assert not isinstance(ended.value, TimeoutError), "the worker was left waiting"
    finally:
        link.close()
        server.stop()


@pytest.mark.timeout(60)
def test_a_session_admitted_before_the_listener_closed_serves_nothing_once_join_returned():
    """A ps session whose thread had been admitted but had not started when ``join`` closed the
    sessions is refused, not served: once ``join`` returns no session thread may still work
    inside torch, or the process can abort as it exits ("terminate called without an active
    exception", a daemon thread stopped inside a torch op)."""
    key = generate_authkey()
    server = unison.Server({"ps": ["127.0.0.1:1"]}, "ps", 0, authkey=key, bind_address="127.0.0.1:0")
    arrived, go = threading.Event(), threading.Event()
    track = server._track

    def late_track(channel):  # the session's thread, paused where it is admitted but not yet tracked
        arrived.set()
        go.wait(30)
        return track(channel)

    server._track = late_track
    outcome: list[BaseException | object] = []

    def open_and_ping():
        try:
            link = open_link(server.address, key, "ps", "ps:0", 20)
            outcome.append(link.request(wire.Ping())[0])
            link.close()
        except BaseException as e:  # noqa: BLE001 - what the peer saw is the result
            outcome.append(e)

    peer = threading.Thread(target=open_and_ping)
    peer.start()
    try:
        assert arrived.wait(20)
        server.stop()
        assert server.join(10)
    finally:
        go.set()
        peer.join(30)
    assert len(outcome) == 1 and isinstance(outcome[0], (ParameterServerError, EOFError, OSError)), outcome


@pytest.mark.timeout(60)
def test_a_session_that_outlives_joins_wait_is_named_with_its_stack(monkeypatch):
    """``join`` waits a bounded time for the sessions it closed; one still running then is named,
    with its stack, in a warning: it could abort the process at exit inside a torch op, and the
    warning says where it was."""
    key = generate_authkey()
    server = unison.Server({"ps": ["127.0.0.1:1"]}, "ps", 0, authkey=key, bind_address="127.0.0.1:0")
    serving, release = threading.Event(), threading.Event()

    def serve_that_ignores_its_socket(store, link):  # a session busy past the socket's shutdown
        serving.set()
        release.wait(30)

    monkeypatch.setattr(task_server, "serve_ps_session", serve_that_ignores_its_socket)
    monkeypatch.setattr(task_server, "SESSION_EXIT_WAIT_S", 0.3)
    link = open_link(server.address, key, "ps", "ps:0", 20)
    try:
        assert serving.wait(20)
        server.stop()
        with pytest.warns(RuntimeWarning, match=r"ps:0: 1 session\(s\) still running 0.3 s after") as caught:
            assert server.join(10)
        text = str(caught[0].message)
        assert "serve_that_ignores_its_socket" in text and "release.wait(30)" in text, text
    finally:
        release.set()
        link.close()
