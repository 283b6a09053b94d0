"""TensorLink: tensors as raw frames beside a pickled header."""

import multiprocessing
import os
import pickle
import socket
import threading

import pytest
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
    sender._out_socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    sender._out_socket.settimeout(30)
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


def test_a_same_host_link_takes_a_whole_row_reply_before_its_reader_reads():
    # a worker with requests out to two ps tasks reads one reply after the other: the second ps task's
    # 256 KB reply must go into the socket whole, not wait mid-write (a Unix socket's default send
    # buffer, 208 KB, made it wait: the PS embedding job ran 0.88x its speed over TCP)
    sender, receiver = _pair()
    assert sender._out_socket.family == socket.AF_UNIX
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as plain:
        default = plain.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    rows = torch.randn(max(1024, default // 256 + 64), 64)  # more bytes than the default buffer holds
    try:
        with open("/proc/sys/net/core/wmem_max") as f:
            most = 2 * int(f.read())  # the kernel doubles what it grants, for its own bookkeeping
    except OSError:
        pytest.skip("no /proc/sys/net/core/wmem_max: cannot tell how far a send buffer may grow")
    if most < rows.numel() * 4 * 5 // 4:
        pytest.skip(f"net.core.wmem_max lets a send buffer grow to {most} bytes only")
    written = threading.Event()
    thread = threading.Thread(target=lambda: (sender.send(("rows",), [rows]), written.set()), daemon=True)
    thread.start()
    assert written.wait(10), "the reply waited for its reader to start reading"
    header, (got,) = receiver.recv()
    assert header == ("rows",) and torch.equal(got, rows)
    thread.join(10)
    sender.close()
    receiver.close()


def test_the_framing_is_multiprocessing_connections_both_ways():
    # a ps session opens with the Channel's messages and goes on with the link's: the header's frame must
    # be the one Connection.send_bytes writes and Connection.recv_bytes reads
    left, right = multiprocessing.Pipe()
    sender, receiver = TensorLink(Channel(left, "right"), "right"), TensorLink(Channel(right, "left"), "left")
    sender.send(("hello", 1))
    assert pickle.loads(right.recv_bytes()) == (("hello", 1), [])
    left.send_bytes(pickle.dumps((("plain", 2), [((3,), torch.int64)])))
    sender._out_socket.sendall(torch.arange(3).numpy().tobytes())
    header, (tensor,) = receiver.recv()
    assert header == ("plain", 2) and torch.equal(tensor, torch.arange(3))
    sender.close()
    receiver.close()


def test_a_message_of_many_tensors_and_every_dtype_and_shape_arrive_intact():
    sender, receiver = _pair()
    g = torch.Generator().manual_seed(5)
    many = [torch.randn(k % 7 + 1, generator=g) for k in range(1_100)]  # more than one sendmsg takes (1,024)
    odd = [torch.tensor(2.5), torch.zeros(0, 4), torch.randn(3, 5, generator=g).to(torch.bfloat16),
           torch.tensor([True, False]), torch.randint(-9, 9, (4, 2), generator=g, dtype=torch.int8),
           torch.randn(6, 4, generator=g)[:, 1]]  # not contiguous: sent as a copy
    thread = threading.Thread(target=lambda: (sender.send(("many",), many), sender.send(("odd",), odd)))
    thread.start()
    for name, tensors in (("many", many), ("odd", odd)):
        header, got = receiver.recv()
        assert header == (name,) and len(got) == len(tensors)
        for a, b in zip(got, tensors):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    thread.join()
    sender.close()
    receiver.close()


def test_a_large_header_between_small_ones_reads_whole():
    sender, receiver = _pair()
    big = ("x" * 20_000, list(range(3_000)))
    thread = threading.Thread(target=lambda: [sender.send(h) for h in (("small",), big, ("small", 2))])
    thread.start()
    assert receiver.recv()[0] == ("small",)
    assert receiver.recv()[0] == big
    assert receiver.recv()[0] == ("small", 2)
    thread.join()
    sender.close()
    receiver.close()


def test_a_peer_that_closes_inside_a_message_is_an_eof_not_a_short_tensor():
    left, right = multiprocessing.Pipe()
    receiver = TensorLink(Channel(right, "left"), "left")
    left.send_bytes(pickle.dumps((("rows",), [((1000,), torch.float32)])))
    raw = socket.socket(fileno=os.dup(left.fileno()))
    raw.sendall(b"\0" * 100)  # 100 of the 4,000 bytes, then gone
    raw.close()
    left.close()
    with pytest.raises(EOFError, match="closed the connection"):
        receiver.recv()
    receiver.close()
