"""``unison.progress.track``: plain lines where no terminal shows the output, tqdm's bar where one does."""

import io

import pytest

from unison._cluster import env
from unison.progress import shows_live_bar, track


class Clock:
    """A clock that advances by one second each time it is read."""

    def __init__(self):
        self.now = -1.0

    def __call__(self):
        self.now += 1.0
        return self.now


class Terminal(io.StringIO):
    def isatty(self):
        return True


class Pipe(io.StringIO):
    """Not a terminal, with the file descriptor of stdout (1) or stderr (2)."""

    def __init__(self, descriptor):
        super().__init__()
        self.descriptor = descriptor

    def fileno(self):
        return self.descriptor


def test_in_a_log_a_line_at_most_every_interval_and_one_at_the_end():
    out = io.StringIO()
    items = list(track(range(25), "epoch 1/12", file=out, interval=10.0, clock=Clock()))
    assert items == list(range(25))
    # started at 0 s; after item k the clock reads k s; a line once 10 s have passed since the last.
    assert out.getvalue() == ("epoch 1/12: 10/25 (40%), 10.0 s, 1 it/s\n"
                              "epoch 1/12: 20/25 (80%), 20.0 s, 1 it/s\n"
                              "epoch 1/12: 25/25 in 26.0 s (0.962 it/s)\n")
    assert "\r" not in out.getvalue()


def test_a_resumed_loop_counts_from_initial_and_rates_only_its_own_items():
    out = io.StringIO()
    list(track(iter(range(3)), "epoch 2/12", total=8, initial=5, file=out, clock=Clock()))
    assert out.getvalue() == "epoch 2/12: 8/8 in 4.0 s (0.75 it/s)\n"
    out = io.StringIO()
    list(track(iter(range(2)), "no length", file=out, clock=Clock()))  # no len(): counted, no share
    assert out.getvalue() == "no length: 2 in 3.0 s (0.667 it/s)\n"


def test_a_loop_left_early_or_disabled_writes_nothing_more():
    out = io.StringIO()
    for item in track(range(10), "loop", file=out, clock=Clock()):
        if item == 3:
            break
    assert out.getvalue() == ""
    out = io.StringIO()
    assert list(track(range(3), "loop", file=out, disable=True)) == [0, 1, 2]
    assert out.getvalue() == ""


def test_a_terminal_gets_tqdms_live_bar():
    out = Terminal()
    assert list(track(range(3), "loop", file=out, leave=True)) == [0, 1, 2]
    assert out.getvalue().startswith("\rloop:") and "3/3" in out.getvalue()


@pytest.mark.parametrize("variable, descriptor, live", [
    (None, 2, False),  # not under unison launch: a pipe is a pipe
    ("stdout,stderr", 2, True),  # the launcher writes its stderr to a terminal
    ("stdout", 2, False),
    ("stdout", 1, True),
    ("stdout,stderr", 7, False),  # some other file
    ("", 1, False),
])
def test_under_the_launcher_the_bar_is_drawn_where_its_stream_is_a_terminal(monkeypatch, variable, descriptor,
                                                                            live):
    if variable is None:
        monkeypatch.delenv(env.UNISON_TERMINAL, raising=False)
    else:
        monkeypatch.setenv(env.UNISON_TERMINAL, variable)
    assert shows_live_bar(Pipe(descriptor)) is live
    assert shows_live_bar(Terminal()) is True
    assert shows_live_bar(io.StringIO()) is False  # no file descriptor at all
