"""TensorLink: tensors as raw frames beside a pickled header."""

import multiprocessing
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
