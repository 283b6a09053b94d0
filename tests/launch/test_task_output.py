"""The launcher's relay of a task's output (``unison._launch.task_output``), without processes:
one prefix a line, carriage returns resolved, partial lines joined, on a terminal and in a log."""

import io
import os
import threading

import pytest

from unison._launch.procs import _Pump
from unison._launch.task_output import OutputRelay, is_terminal, terminal_streams

EL = "\x1b[K"

#: What tqdm writes for a loop of 3 with ``leave=False``: "\r" + bar per update, then clears the line.
TQDM_CLEARED = b"\repoch 1:   0%| | 0/3\repoch 1:  33%|# | 1/3\repoch 1: 100%|##| 3/3\r" + b" " * 20 + b"\r"


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def relay_all(chunks, *, terminal=False, interval=10.0, clock=None):
    relay = OutputRelay("[worker:0]", terminal=terminal, interval=interval, clock=clock or Clock())
    return "".join(relay.feed(chunk) for chunk in chunks) + relay.close()


def test_in_a_log_a_cleared_progress_bar_leaves_one_clean_line_after_it():
    out = relay_all([TQDM_CLEARED + b"epoch 1: loss 0.5\n"])
    assert out == "[worker:0] epoch 1: loss 0.5\n"


def test_in_a_log_the_last_update_of_a_line_wins_and_is_prefixed_once():
    # tqdm with leave=True: the final bar ends with a newline.
    out = relay_all([b"\rstep 0/3\rstep 1/3\rstep 3/3 done   \n", b"next\n"])
    assert out == "[worker:0] step 3/3 done\n[worker:0] next\n"
    # A line with nothing after its last "\r" shows that update (as a terminal would).
    assert relay_all([b"half\r\n"]) == "[worker:0] half\n"
    assert relay_all([b"one\rtwo\r"]) == "[worker:0] two\n"  # the pipe closed mid-redraw


def test_lines_split_across_chunks_and_partial_lines_come_out_whole():
    chunks = [b"hel", b"lo wor", b"ld\nsecond ", b"line\n\n", b"no newline at the end"]
    assert relay_all(chunks) == ("[worker:0] hello world\n[worker:0] second line\n[worker:0] \n"
                                 "[worker:0] no newline at the end\n")
    # "\r\n" split between two chunks is a line end, not a redraw.
    assert relay_all([b"windows\r", b"\nline\r\n"]) == "[worker:0] windows\n[worker:0] line\n"
    # A character split between chunks is decoded whole.
    text = "déjà vu\n".encode()
    assert relay_all([text[:2], text[2:]]) == "[worker:0] déjà vu\n"


def test_in_a_log_a_long_redrawn_line_shows_an_update_at_most_every_interval():
    clock = Clock()
    relay = OutputRelay("[worker:0]", terminal=False, interval=10.0, clock=clock)
    out = []
    for step in range(31):  # one update a second for 30 s
        clock.now = float(step)
        out.append(relay.feed(f"\rstep {step}".encode() + b" " * 3))
    clock.now = 31.0
    out.append(relay.feed(b"\rstep 30\n"))  # the final update equals the last written: not twice
    out.append(relay.feed(b"after\n"))
    # The first update starts the clock; then the newest update once every 10 s.
    assert "".join(out) == ("[worker:0] step 10\n[worker:0] step 20\n[worker:0] step 30\n"
                            "[worker:0] after\n")
    assert relay.close() == ""


def test_on_a_terminal_redraws_stay_live_with_one_prefix_each():
    relay = OutputRelay("[worker:0]", terminal=True)
    # tqdm writes "\r" and then the bar: the bar shows at once (not when the next "\r" ends
    # it), with one prefix, the cursor back at the line's start; each redraw erases what the
    # previous one left, so a shorter update or another task's line leaves no debris.
    assert relay.feed(b"\rstep 0\rstep 1") == f"\r[worker:0] step 0{EL}\r[worker:0] step 1{EL}\r"
    assert relay.feed(b"0\rstep 2\r") == f"[worker:0] step 10{EL}\r[worker:0] step 2{EL}\r"
    assert relay.feed(b"done\n") == f"[worker:0] done{EL}\n"  # "step 2" is on screen already
    assert relay.feed(b"\r" + b" " * 12 + b"\r") == f"\r{EL}\r"  # a cleared bar: no prefix on it
    assert relay.feed(b"lo") == f"[worker:0] lo{EL}\r"  # still a redrawn line
    assert relay.feed(b"ng\r\n") == f"[worker:0] long{EL}\r\n"
    assert relay.feed(b"tail") == ""  # a plain line shows once it ends
    assert relay.close() == f"[worker:0] tail{EL}\n"


def test_the_launcher_tells_its_tasks_which_of_its_streams_are_terminals():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    class Closed(io.StringIO):
        def isatty(self):
            raise ValueError("I/O operation on closed file")

    assert terminal_streams(Terminal(), Terminal()) == "stdout,stderr"
    assert terminal_streams(io.StringIO(), Terminal()) == "stderr"
    assert terminal_streams(io.StringIO(), Closed()) == ""
    assert not is_terminal(object())  # type: ignore[arg-type]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("terminal", [False, True])
def test_the_pump_relays_a_pipe_by_what_its_sink_is(terminal):
    class Sink(io.StringIO):
        def isatty(self):
            return terminal

    read, write = os.pipe()
    sink = Sink()
    pump = _Pump(open(read, "rb", buffering=0), "[worker:1]", sink, threading.Lock())  # the pump closes it
    pump.start()
    with open(write, "wb", buffering=0) as writer:
        writer.write(b"\rbar 1\rbar 2\r")
        writer.write(b"     \rresult\n")
    pump.join(timeout=20)
    assert not pump.is_alive()
    if terminal:  # (the two writes may come in one read or in two: the end is the same)
        assert sink.getvalue().endswith(f"[worker:1] bar 2{EL}\r{EL}\r[worker:1] result{EL}\n")
        assert sink.getvalue().count("[worker:1] bar 1") == 1
    else:
        assert sink.getvalue() == "[worker:1] result\n"
