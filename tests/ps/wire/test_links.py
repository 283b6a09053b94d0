"""TensorLink: tensors as raw frames beside a pickled header."""

import multiprocessing
import socket
import threading

import torch

from unison._coordinator.channel import Channel
from unison._ps.wire.links import TensorLink


def _pair():
    left, right = multiprocessing.Pipe()  # a socket pair on Linux: the frames go through it as over TCP
    return TensorLink(Channel(left, "right"), "right"), TensorLink(Channel(right, "left"), "left")


def test_requests_of_varying_sizes_keep_one_receive_buffer_per_position():
    sender, receiver = _pair()
    sizes = [5, 17, 9, 33, 2]
    sent = [(torch.arange(n), torch.rand(n, 3)) for n in sizes]

    def send_all():
        for ids, rows in sent:
            sender.send(("rows", len(ids)), [ids, rows])

    thread = threading.Thread(target=send_all)
    thread.start()
    for ids, rows in sent:
        header, (got_ids, got_rows) = receiver.recv(reuse=True)
        assert header == ("rows", len(ids)) and torch.equal(got_ids, ids) and torch.equal(got_rows, rows)
    thread.join()
    # a ps task answers batches of every size: it must not keep a buffer per size it has seen
    assert len(receiver._scratch) == 2
    sender.close()
    receiver.close()


def test_a_message_larger_than_the_socket_buffer_arrives_whole_in_order():
    # on a socket that takes part of a message at a time (non-blocking under a timeout, a small send
    # buffer) a write may end inside any frame, and the peer still reads the header, the tensors and the
    # next message intact
    sender, receiver = _pair()
    sender._socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    sender._socket.settimeout(30)
    g = torch.Generator().manual_seed(3)
    sent = [(("big", n), [torch.randn(n, 7, generator=g), torch.arange(n), torch.zeros(0)])
            for n in (300_000, 1, 70_001)]
    thread = threading.Thread(target=lambda: [sender.send(header, tensors) for header, tensors in sent])
    thread.start()
    for header, tensors in sent:
        got_header, got = receiver.recv()
        assert got_header == header and len(got) == len(tensors)
        assert all(torch.equal(a, b) for a, b in zip(got, tensors))
    thread.join()
    sender.close()
    receiver.close()
