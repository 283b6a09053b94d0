"""The simulated hosts themselves: separate addresses, private /dev/shm, nothing left behind."""

import subprocess
import sys
import time

import pytest

from unison._testing.hosts import SimulatedHosts, remove_orphaned_namespaces


@pytest.mark.timeout(60)
def test_hosts_reach_each_other_but_not_each_others_shared_memory(simulated_hosts):
    hosts = simulated_hosts(2, shm_sizes={1: "64k"})
    server = hosts.popen(1, [sys.executable, "-c", (
        "import socket; s = socket.create_server(('0.0.0.0', 7000)); print('ready', flush=True); "
        "c, _ = s.accept(); c.sendall(open('/proc/self/mounts').read().encode()); c.close()")])
    assert server.stdout.readline().strip() == "ready"
    write = hosts.run(0, ["sh", "-c", "echo x > /dev/shm/unison-probe && ls /dev/shm"])
    assert write.returncode == 0 and "unison-probe" in write.stdout
    client = hosts.run(0, [sys.executable, "-c", (
        f"import socket; c = socket.create_connection(({hosts.address(1)!r}, 7000), timeout=10); "
        "print(b''.join(iter(lambda: c.recv(65536), b'')).decode())")])
    assert client.returncode == 0, client.stdout
    assert "tmpfs /dev/shm tmpfs" in client.stdout and "size=64k" in client.stdout  # host 1's own /dev/shm
    assert "unison-probe" not in hosts.run(1, ["ls", "/dev/shm"]).stdout
    assert "unison-probe" not in subprocess.run(["ls", "/dev/shm"], capture_output=True, text=True).stdout
    server.wait(timeout=10)


@pytest.mark.timeout(60)
def test_closing_kills_every_process_and_deletes_the_namespaces(simulated_hosts):
    hosts = simulated_hosts(2)
    # A process in a session of its own, as launched tasks are: the process group kill misses it.
    hosts.popen(0, ["setsid", "sh", "-c", "sleep 300 & sleep 300"])
    sleeper = hosts.popen(1, ["sleep", "300"])
    names = [h.namespace for h in hosts.hosts]
    deadline = time.monotonic() + 10
    # `ip netns exec` enters the namespace just after it starts, and `mount` runs as a
    # short-lived child before the command replaces the shell: poll until only it is left.
    while hosts.pids(1) != [sleeper.pid]:
        assert time.monotonic() < deadline, hosts.pids(1)
        time.sleep(0.02)
    hosts.close()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listed for name in names)
    assert sleeper.returncode is not None


def test_bad_host_count_is_refused():
    with pytest.raises(ValueError, match="count=0"):
        SimulatedHosts(0)


# Host 1 sends `size` bytes to host 0 and host 0 prints the seconds they took to arrive.
SINK = (
    "import socket, time; s = socket.create_server(('0.0.0.0', 7000)); print('ready', flush=True); "
    "c, _ = s.accept(); n = 0; t = None\n"
    "while chunk := c.recv(1 << 20):\n"
    "    t = t or time.perf_counter(); n += len(chunk)\n"
    "print(n, time.perf_counter() - t)"
)


@pytest.mark.timeout(60)
def test_a_link_rate_makes_the_network_slower_than_memory(simulated_hosts):
    hosts = simulated_hosts(2, link_rate="80mbit")  # 10 MB/s
    assert "tbf" in hosts.run(1, ["tc", "qdisc", "show", "dev", "eth0"]).stdout
    sink = hosts.popen(0, [sys.executable, "-c", SINK])
    assert sink.stdout.readline().strip() == "ready"
    size = 4_000_000
    sent = hosts.run(1, [sys.executable, "-c", (
        f"import socket; c = socket.create_connection(({hosts.address(0)!r}, 7000), timeout=20); "
        f"c.sendall(bytes({size})); c.close()")])
    assert sent.returncode == 0, sent.stdout
    received, seconds = sink.communicate(timeout=30)[0].split()
    assert int(received) == size
    assert 0.25 <= float(seconds) <= 5  # 0.4 s at 10 MB/s (unlimited: a few ms)


@pytest.mark.timeout(60)
def test_a_link_delay_slows_every_round_trip(simulated_hosts):
    try:
        hosts = simulated_hosts(2, link_delay_ms=20)
    except RuntimeError as e:
        if "no netem qdisc" not in str(e):  # a kernel without netem is the one refusal that skips
            raise
        pytest.skip("the delay is not measured: this kernel has no netem qdisc (sch_netem), so link_delay_ms "
                    "cannot be simulated; `modprobe sch_netem` where the kernel ships it")
    assert "netem" in hosts.run(0, ["tc", "qdisc", "show", "dev", "eth0"]).stdout
    server = hosts.popen(1, [sys.executable, "-c", (
        "import socket; s = socket.create_server(('0.0.0.0', 7000)); print('ready', flush=True); "
        "c, _ = s.accept(); c.recv(1); c.sendall(b'x'); c.close()")])
    assert server.stdout.readline().strip() == "ready"
    client = hosts.run(0, [sys.executable, "-c", (
        f"import socket, time; c = socket.create_connection(({hosts.address(1)!r}, 7000), timeout=10); "
        "t = time.perf_counter(); c.sendall(b'x'); c.recv(1); print(time.perf_counter() - t)")])
    assert float(client.stdout.split()[-1]) >= 0.035  # 20 ms out of each host: >= 40 ms a round trip
    server.wait(timeout=10)


@pytest.mark.timeout(60)
def test_namespaces_of_a_dead_maker_are_removed_by_the_next_one(simulated_hosts):
    simulated_hosts(1)  # skips where namespaces are not allowed
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer runs
    name = f"unison-{dead.pid}x0-h0"
    subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
    sleeper = subprocess.Popen(["ip", "netns", "exec", name, "sleep", "300"])
    deadline = time.monotonic() + 10
    while not subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.strip():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert name in remove_orphaned_namespaces()
    assert sleeper.wait(timeout=10) == -9
    assert name not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
