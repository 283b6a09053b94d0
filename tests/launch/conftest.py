"""Fixtures of the launcher's tests."""

from __future__ import annotations

import signal

import pytest


@pytest.fixture
def sigint_as_in_a_terminal():
    """SIGINT handled as in a terminal while the test starts its processes.

    A process started as a background job of a shell (``make test &``) ignores SIGINT, and so does
    every process it starts, a launcher included: that launcher would rightly ignore the test's
    Ctrl-C. The processes a test starts meanwhile inherit the default disposition instead."""
    previous = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)
