"""The control channel: keys, and refusal of peers without the key before any unpickling."""

import os
import pickle
import socket
import struct
import sys
import threading
import time

import pytest

from unison._coordinator.channel import ChannelListener, connect, require_authkey
from unison.coordinator import StandardServer, generate_authkey, read_authkey, stop_standard_servers
from unison.errors import AuthenticationError, ClusterError

KEY = bytes(range(32))


# --- keys ---------------------------------------------------------------------------------


def test_generated_keys_are_random_and_long():
    first, second = generate_authkey(), generate_authkey()
    assert len(first) == 32 and first != second


def test_read_authkey_from_variable_and_file(tmp_path):
    assert read_authkey({}) is None
    assert read_authkey({"UNISON_AUTHKEY": KEY.hex()}) == KEY
    path = tmp_path / "key"
    path.write_text(KEY.hex() + "\n")
    assert read_authkey({"UNISON_AUTHKEY_FILE": str(path)}) == KEY


@pytest.mark.parametrize(
    "environ, match",
    [
        ({"UNISON_AUTHKEY": "zz" * 16}, "UNISON_AUTHKEY is not a hex string"),
        ({"UNISON_AUTHKEY": "ab" * 8}, "UNISON_AUTHKEY holds a 8-byte key; use at least 16 bytes"),
        ({"UNISON_AUTHKEY": "ab" * 16, "UNISON_AUTHKEY_FILE": "/x"},
         "both UNISON_AUTHKEY and UNISON_AUTHKEY_FILE are set"),
        ({"UNISON_AUTHKEY_FILE": "/nonexistent/key"}, r"UNISON_AUTHKEY_FILE='/nonexistent/key' cannot be read"),
    ],
)
def test_bad_keys(environ, match):
    with pytest.raises(ValueError, match=match) as info:
        read_authkey(environ)
    assert "zz" * 16 not in str(info.value)  # a key is never echoed


def test_require_authkey():
    assert require_authkey(KEY, {}) == KEY
    with pytest.raises(ValueError, match="set UNISON_AUTHKEY"):
        require_authkey(None, {})
    with pytest.raises(TypeError, match="authkey must be bytes, got str"):
        require_authkey(KEY.hex(), {})


# --- listener -----------------------------------------------------------------------------


class Echo:
    """A handler that echoes messages and records every peer it was handed."""

    def __init__(self):
        self.peers = []

    def __call__(self, channel):
        self.peers.append(channel.peer)
        try:
            while True:
                channel.send(("echo", channel.recv()))
        except (EOFError, OSError):
            channel.close()


@pytest.fixture
def listener():
    handler = Echo()
    listener = ChannelListener("127.0.0.1:0", KEY, handler)
    listener.handler = handler
    yield listener
    listener.close()


@pytest.mark.timeout(30)
def test_right_key_round_trip(listener):
    channel = connect(listener.address, KEY, timeout=5)
    channel.send(("hello", [1, 2]))
    assert channel.recv() == ("echo", ("hello", [1, 2]))
    channel.send(lambda x: x + 1)  # cloudpickle carries lambdas
    assert channel.recv()[1](1) == 2
    channel.close()


class Evil:
    """Unpickling this creates the marker file: proof that a pickle was loaded."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _port(listener):
    return int(listener.address.rsplit(":", 1)[1])


def _framed(payload):
    return struct.pack("!i", len(payload)) + payload


def _refused_count_reaches(listener, count):
    """Polls the refusal counter: the server counts just after telling the peer."""
    deadline = time.monotonic() + 5
    while listener.refused < count and time.monotonic() < deadline:
        time.sleep(0.01)
    return listener.refused >= count


@pytest.mark.timeout(30)
def test_wrong_key_is_refused_and_nothing_it_sent_is_unpickled(listener, tmp_path):
    marker = tmp_path / "executed"
    with pytest.raises(AuthenticationError, match="refused this client's key"):
        connect(listener.address, b"x" * 32, timeout=5)
    # A raw peer that skips the handshake and sends pickles straight away.
    raw = socket.create_connection(("127.0.0.1", _port(listener)))
    evil = pickle.dumps(Evil(marker))
    raw.sendall(_framed(evil) * 3)
    assert _refused_count_reaches(listener, 2)
    raw.close()
    # A raw peer that reads the challenge, answers wrongly, then sends a pickle anyway.
    raw = socket.create_connection(("127.0.0.1", _port(listener)))
    raw.recv(1024)
    raw.sendall(_framed(os.urandom(16)) + _framed(evil))
    assert _refused_count_reaches(listener, 3)
    raw.close()
    assert listener.handler.peers == []
    assert not marker.exists()
    # The listener still serves a client with the key.
    channel = connect(listener.address, KEY, timeout=5)
    channel.send("still there?")
    assert channel.recv() == ("echo", "still there?")
    channel.close()
    assert len(listener.handler.peers) == 1 and not marker.exists()


@pytest.mark.timeout(30)
def test_a_silent_peer_does_not_block_other_clients(listener):
    silent = socket.create_connection(("127.0.0.1", _port(listener)))
    try:
        channel = connect(listener.address, KEY, timeout=5)
        channel.send(1)
        assert channel.recv() == ("echo", 1)
        channel.close()
    finally:
        silent.close()


@pytest.mark.timeout(30)
def test_standard_server_refuses_wrong_key_and_keeps_serving(tmp_path):
    """An in-process standard server: the wrong client's function never runs."""
    marker = tmp_path / "ran"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cluster = {"worker": [f"127.0.0.1:{port}"]}
    with StandardServer(cluster, "worker", 0, authkey=KEY) as server:
        assert server.address == f"127.0.0.1:{port}"  # its own cluster address, not 0.0.0.0
        from unison._coordinator.distribute_coordinator import _drive_task
        from unison._coordinator.standard_server import RunRequest

        request = RunRequest(lambda s: marker.write_text("x"), None, cluster, "worker", 0, "tcp", use_barrier=False)
        with pytest.raises(AuthenticationError):
            _drive_task(server.address, b"y" * 32, request, threading.Barrier(1), timeout=5)
        assert _refused_count_reaches(server, 1) and not marker.exists()
        request = RunRequest(lambda s: "ran as the right client", None, cluster, "worker", 0, "tcp", use_barrier=False)
        assert _drive_task(server.address, KEY, request, threading.Barrier(1), timeout=5) == "ran as the right client"


@pytest.mark.timeout(30)
def test_join_returns_once_the_thread_that_served_the_stop_has_ended(monkeypatch):
    """A ps task exits right after join(): the thread that served the client's stop must have ended
    by then (Python stops a daemon thread still running at exit wherever it is; inside a torch op
    that aborts the process). Here that thread still has 0.3 s of work after serving the stop."""
    served = []
    serve = StandardServer._serve

    def serve_then_linger(self, channel):
        served.append(threading.current_thread())
        serve(self, channel)
        time.sleep(0.3)

    monkeypatch.setattr(StandardServer, "_serve", serve_then_linger)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cluster = {"worker": [f"127.0.0.1:{port}"]}
    server = StandardServer(cluster, "worker", 0, authkey=KEY).start()
    try:
        assert stop_standard_servers(cluster, authkey=KEY, timeout=10) == ["worker:0"]
        assert server.join(timeout=10)
        assert len(served) == 1 and not served[0].is_alive()
    finally:
        server.stop()


@pytest.mark.timeout(30)
def test_connect_gives_up_with_a_cluster_error():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(ClusterError, match=f"no standard server answered at '127.0.0.1:{port}' within 0.3 s"):
        connect(f"127.0.0.1:{port}", KEY, timeout=0.3)


def test_run_standard_server_without_a_task_names_the_value_and_the_fix(monkeypatch):
    """Unreachable through parse_tf_config(require_task=True), but a clear message if it ever is."""
    from unison._cluster.spec import ClusterSpec
    from unison._cluster.tf_config import TFConfig
    from unison._coordinator import standard_server as server_module

    monkeypatch.setattr(server_module, "read_tf_config",
                        lambda environ, require_task: TFConfig(ClusterSpec({"worker": ["127.0.0.1:1"]})))
    with pytest.raises(ValueError, match=r"no task \(task type None, index None; "
                                         r"cluster \{'worker': \['127.0.0.1:1'\]\}\)"
                                         r".*add \"task\": \{\"type\": \"worker\", \"index\": 0\}"):
        server_module.run_standard_server(authkey=KEY)


def test_handshake_timeout_must_be_positive():
    with pytest.raises(ValueError, match="handshake_timeout must be a positive number of seconds, got 0"):
        StandardServer({"worker": ["127.0.0.1:1"]}, "worker", 0, authkey=KEY, handshake_timeout=0)


@pytest.mark.timeout(30)
def test_listener_keeps_accepting_when_no_thread_can_be_started(monkeypatch, caplog):
    """Out of threads ("can't start new thread"): one warning, a back-off, then service again."""
    from unison._coordinator import channel as channel_module

    real_thread = threading.Thread
    failures = {"left": 3}

    class Starved(real_thread):
        def start(self):
            if self.name.startswith("Thread") and failures["left"] > 0:  # handshake threads only
                failures["left"] -= 1
                raise RuntimeError("can't start new thread")
            super().start()

    handler = Echo()
    listener = ChannelListener("127.0.0.1:0", KEY, handler)
    try:
        monkeypatch.setattr(channel_module.threading, "Thread", Starved)
        caplog.set_level("INFO", logger=channel_module.__name__)
        port = _port(listener)
        dropped = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
        channel = connect(listener.address, KEY, timeout=10)
        channel.send("served")
        assert channel.recv() == ("echo", "served")
        channel.close()
        for sock in dropped:
            sock.close()
        warnings = [r for r in caplog.records if "cannot accept a connection" in r.getMessage()]
        assert len(warnings) == 1 and "cannot start a handshake thread" in warnings[0].getMessage()
        assert any("accepts connections again" in r.getMessage() for r in caplog.records)
    finally:
        monkeypatch.undo()
        listener.close()


# --- the same-host socket ------------------------------------------------------------------

def _family(channel):
    with socket.socket(fileno=os.dup(channel.connection.fileno())) as view:
        return view.family


same_host_sockets = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract Unix sockets are Linux's")


@same_host_sockets
@pytest.mark.timeout(30)
def test_same_host_first_connects_over_the_unix_socket_behind_the_same_handshake(listener):
    channel = connect(listener.address, KEY, timeout=5, same_host_first=True)
    assert _family(channel) == socket.AF_UNIX
    channel.send(("hello", [1, 2]))
    assert channel.recv() == ("echo", ("hello", [1, 2]))
    channel.close()
    assert listener.handler.peers[-1] == f"a same-host peer of {listener.address}"
    tcp = connect(listener.address, KEY, timeout=5)  # without asking: TCP, as for another host
    assert _family(tcp) == socket.AF_INET
    tcp.close()
    with pytest.raises(AuthenticationError, match="refused this client's key"):
        connect(listener.address, bytes(32), timeout=5, same_host_first=True)
    assert _refused_count_reaches(listener, 1)


@same_host_sockets
@pytest.mark.timeout(30)
def test_same_host_first_falls_back_to_tcp_where_the_listener_has_no_unix_socket(monkeypatch):
    import unison._coordinator.channel as channel_module

    monkeypatch.setattr(channel_module, "_listen_locally", lambda host, port: None)  # e.g. its name was taken
    handler = Echo()
    plain = ChannelListener("127.0.0.1:0", KEY, handler)
    try:
        channel = connect(plain.address, KEY, timeout=5, same_host_first=True)
        assert _family(channel) == socket.AF_INET
        channel.send("hi")
        assert channel.recv() == ("echo", "hi")
        channel.close()
    finally:
        plain.close()


@same_host_sockets
@pytest.mark.timeout(30)
def test_a_closed_listener_releases_its_unix_name():
    import unison._coordinator.channel as channel_module

    closing = ChannelListener("127.0.0.1:0", KEY, Echo())
    host, port = closing.address.rsplit(":", 1)
    name = channel_module.local_socket_name(host, int(port))
    probe = channel_module._connect_locally(host, int(port))
    assert probe is not None
    probe.close()
    closing.close()
    assert channel_module._connect_locally(host, int(port)) is None
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as again:  # and the name can be bound anew
        again.bind(name)
