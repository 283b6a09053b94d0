"""The standalone client's rendezvous store reaches a worker's strategy as an argument.

The leader's cluster address is held by its standard server, so the client opens the
workers' store and names it in each request; the server hands it to the strategy's
``configure`` and leaves its own environment (shared by every thread) alone.
"""

import os

import pytest
from _coordinator_fakes import FakeStrategy

import unison
from unison import ClusterSpec
from unison._cluster.resolved import RendezvousKind
from unison._coordinator.channel import connect
from unison._coordinator.standard_server import RunRequest, StandardServer
from unison._coordinator.worker_context import run_in_worker_context
from unison.coordinator import generate_authkey

CLUSTER = {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}
STORE = "127.0.0.1:5555"


def environment_and_rendezvous(strategy):
    return dict(os.environ), strategy.rendezvous


@pytest.mark.timeout(30)
def test_the_standard_server_passes_the_store_to_configure_and_leaves_os_environ_alone(monkeypatch):
    monkeypatch.delenv("UNISON_RENDEZVOUS", raising=False)
    key = generate_authkey()
    before = dict(os.environ)
    with StandardServer(CLUSTER, "worker", 1, authkey=key, bind_address="127.0.0.1:0") as server:
        channel = connect(server.address, key, timeout=10)
        try:
            channel.send(("run", RunRequest(environment_and_rendezvous, FakeStrategy(), CLUSTER, "worker", 1, "tcp",
                                            use_barrier=False, rendezvous=STORE)))
            reply = channel.recv()
        finally:
            channel.close()
    assert reply[0] == "result", reply
    during, rendezvous = reply[1]
    assert rendezvous == STORE
    assert during == before and dict(os.environ) == before


def test_a_multi_worker_strategy_configured_with_a_store_meets_there(monkeypatch):
    monkeypatch.delenv("UNISON_RENDEZVOUS", raising=False)
    strategy = unison.MultiWorkerMirroredStrategy(unison.SimpleClusterResolver())  # local; nothing connects

    def cluster_of(configured):
        return configured.extended.components.cluster

    cluster = run_in_worker_context(cluster_of, strategy, ClusterSpec(CLUSTER), "worker", 1, rendezvous=STORE)
    assert (cluster.rendezvous, cluster.rendezvous_address, cluster.rank) == (RendezvousKind.STORE, STORE, 1)
    alone = run_in_worker_context(cluster_of, strategy, ClusterSpec(CLUSTER), "worker", 1)
    assert (alone.rendezvous, alone.rendezvous_address) == (RendezvousKind.LEADER, "127.0.0.1:1")
