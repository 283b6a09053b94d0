"""Row pushes are sent without waiting and answered only when they fail (protocol 7): a failed
push's error is raised by the worker's next request to that ps task, which is not applied, and
by ``settle``; the session goes on after it. A real ps server in this process, reached over
its socket or, as a worker that serves the ps task itself reaches it, in process."""

from __future__ import annotations

import pytest
import torch

import unison
from unison._coordinator.channel import generate_authkey
from unison._embeddings.optim.row_optimizers import RowSGD
from unison._embeddings.tables.initializers import Uniform
from unison._embeddings.tables.table import TableConfig
from unison._ps.wire import protocol as wire
from unison._ps.wire.client import PSClient
from unison._ps.worker.remote_table import RemoteTable

DIM = 4
SGD = RowSGD(lr=1.0)


@pytest.fixture(params=["socket", "in_process"])
def table(request):
    key = generate_authkey()
    in_process = request.param == "in_process"
    server = unison.Server({"ps": ["127.0.0.1:1"]}, "ps", 0, authkey=key, bind_address="127.0.0.1:0",
                           in_process=in_process)
    client = PSClient(["127.0.0.1:1" if in_process else server.address], key, timeout=10, reply_timeout=10)
    config = TableConfig(DIM, torch.float32, Uniform(-0.1, 0.1), 0, None)
    remote = RemoteTable("t", 1, config, lambda: client)
    try:
        remote.create()
        yield remote, client
    finally:
        client.close()
        server.stop()


def _rows(remote, ids):
    return remote.lookup(ids, create=False)


@pytest.mark.timeout(60)
def test_a_push_that_succeeds_has_no_reply_and_the_next_lookup_sees_it(table):
    remote, client = table
    ids = torch.tensor([3, 7, 11])
    before = remote.lookup(ids)
    remote.push(ids, torch.ones(3, DIM), SGD)
    link = client._links[0]
    if link.in_process:
        assert link._answer is None  # nothing waits to be read for it
    else:
        assert not link._in_connection.poll(0.5)  # nothing comes back for it
    assert torch.allclose(_rows(remote, ids), before - 1.0)
    assert not client._unconfirmed  # the lookup's reply confirmed the push


@pytest.mark.timeout(60)
def test_a_failed_push_is_raised_by_the_next_request_which_is_not_applied(table):
    remote, client = table
    ids = torch.tensor([3, 7, 11])
    before = remote.lookup(ids)
    remote.push(ids, torch.ones(3, DIM + 1), SGD)  # the ps task cannot apply this one
    remote.push(ids, torch.ones(3, DIM), SGD)  # nor, after it, this one: not applied either
    with pytest.raises(Exception) as caught:
        remote.lookup(torch.tensor([5]))  # would make row 5
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    assert "raised on ps:0 by an earlier request sent without waiting (a row push)" in notes, notes
    assert "was not applied" in notes and "traceback on ps:0" in notes, notes
    # the session goes on: no row changed, and row 5 was not made by the refused lookup
    assert torch.equal(_rows(remote, ids), before)
    assert remote.num_rows == 3
    remote.push(ids, torch.ones(3, DIM), SGD)
    client.settle()
    assert torch.allclose(_rows(remote, ids), before - 1.0)


@pytest.mark.timeout(60)
def test_settle_raises_a_failed_push_and_confirms_the_others(table):
    remote, client = table
    ids = torch.tensor([1, 2])
    before = remote.lookup(ids)
    remote.push(ids, torch.ones(2, DIM), SGD)
    client.settle()
    assert not client._unconfirmed
    assert torch.allclose(_rows(remote, ids), before - 1.0)
    remote.push(ids, torch.ones(2, DIM + 1), SGD)
    with pytest.raises(Exception) as caught:
        client.settle()
    assert any("a row push" in note for note in getattr(caught.value, "__notes__", []))
    client.settle()  # reported once: nothing is pending now
    assert torch.allclose(_rows(remote, ids), before - 1.0)


def test_a_request_with_a_reply_cannot_be_sent_without_waiting(table):
    _, client = table
    with pytest.raises(ValueError, match=r"exchange\(wait=False\) sends only requests that have no reply"):
        client.exchange({0: (wire.Ping(), (), None)}, wait=False)
