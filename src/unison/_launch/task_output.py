"""How a task's output reads once ``unison launch`` relays it: one prefix a line, carriage returns resolved.

A task's stdout and stderr are pipes to the launcher, which writes every line with the
task's prefix (``[worker:0] ...``). A progress bar (tqdm) redraws its line: ``\\r`` and
the bar, again and again, until a newline or a cleared line. Copied as they came, the
redraws kept their place on a terminal, but in a log or a CI job they piled up into one
long line, and tqdm's leading ``\\r`` got a prefix of its own (the prefix showed twice).
:class:`OutputRelay` turns the bytes of one pipe into what the launcher writes:

- to a terminal: each redraw as it comes, prefixed once, erasing what is left of the
  previous one, so the live bar stays live. tqdm writes ``\r`` *before* each bar, so a
  bar is shown as soon as it arrives, not when the next one ends it; until its line
  ends, the cursor goes back to the line's start, so that another task's line written
  meanwhile replaces it instead of being glued to it;
- to anything else: whole lines only. A redrawn line is written as its last update (the
  last update of a line wins); while it is being redrawn, its newest update is written as
  a line of its own at most once every ``interval`` seconds, so a long loop still shows
  its progress in a log at a modest rate. A line that was redrawn and then cleared
  (tqdm's ``leave=False``) is left out.

Tasks learn which of the launcher's streams are terminals from ``UNISON_TERMINAL``
(``terminal_streams``), so that ``unison.progress.track`` draws a live bar only where
one is seen.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import IO

__all__ = ["OutputRelay", "is_terminal", "terminal_streams"]

#: ANSI "erase to the end of the line": what a shorter redraw leaves of a longer one goes.
_ERASE_TO_END = "\x1b[K"

#: The longest unfinished line drawn before it ends (a terminal line is far shorter).
_LONGEST_DRAWN = 4096

#: Ends of segments: after each newline, and after each carriage return not part of "\r\n".
_SEGMENT_END = re.compile(rb"(?<=\n)|(?<=\r)(?!\n)")


def is_terminal(stream: IO[str]) -> bool:
    """Whether ``stream`` is a terminal (False for anything without a working ``isatty``)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, OSError, ValueError):
        return False


def terminal_streams(stdout: IO[str], stderr: IO[str]) -> str:
    """``UNISON_TERMINAL``'s value for the tasks: which of the launcher's streams are terminals.

    ``"stdout,stderr"``, ``"stdout"``, ``"stderr"`` or ``""``.
    """
    return ",".join(name for name, stream in (("stdout", stdout), ("stderr", stderr)) if is_terminal(stream))


class OutputRelay:
    """Turns the bytes of one task's pipe into prefixed text for the launcher's stream.

    Pure (no threads, no I/O): ``feed`` each chunk as it is read, ``close`` once the
    pipe is closed, and write what they return.

    Args:
        prefix: written before every line, e.g. ``"[worker:0]"``.
        terminal: whether the text goes to a terminal (live redraws) or not (whole lines).
        interval: the shortest time in seconds between two updates of a redrawn line
            written as lines of their own (not to a terminal).
        clock: seconds, monotonic (tests pass their own).
    """

    def __init__(self, prefix: str, *, terminal: bool, interval: float = 10.0,
                 clock: Callable[[], float] = time.monotonic):
        self._prefix, self._terminal, self._interval, self._clock = prefix, terminal, interval, clock
        self._pending = b""
        #: not to a terminal: the newest update of the line being redrawn (None: no update yet)
        self._update: bytes | None = None
        #: the update last written as a line of its own, and when that was (or the first update came)
        self._shown: bytes | None = None
        self._since = 0.0
        #: to a terminal: whether the line being written has been redrawn ("\r"), and the
        #: unfinished text of it on screen (the cursor back at the line's start)
        self._redrawing = False
        self._drawn: bytes | None = None

    def feed(self, data: bytes) -> str:
        """The text to write for ``data``, the next bytes read from the pipe."""
        buffer = self._pending + data
        # A "\r" at the very end may be the first half of "\r\n": decide with the next bytes.
        held = b"\r" if buffer.endswith(b"\r") else b""
        *segments, rest = _SEGMENT_END.split(buffer[:len(buffer) - len(held)])
        self._pending = rest + held
        text = "".join(self._segment(segment) for segment in segments)
        # To a terminal, an unfinished redraw at once: a bar waiting for its next update (not a
        # plain line, nor a long one arriving in pieces: each piece would draw all of it again).
        if self._redrawing and rest and rest != self._drawn and len(rest) <= _LONGEST_DRAWN:
            self._drawn = rest
            text += self._draw(rest, errors="ignore")  # a character cut in two shows once whole
        return text

    def close(self) -> str:
        """The text to write once the pipe is closed: its unfinished last line, if any, ended."""
        rest, self._pending = self._pending, b""
        text = self._segment(rest if rest.endswith(b"\r") else rest + b"\n") if rest else ""
        if not self._terminal and self._update is not None:
            text += self._end_line(b"")
        return text

    def _segment(self, segment: bytes) -> str:
        if segment.endswith(b"\r"):
            self._redrawing = self._terminal
            return self._redraw(segment[:-1])
        end = 2 if segment.endswith(b"\r\n") else 1
        text = segment[:-end]
        if self._terminal:
            self._redrawing, self._drawn = False, None
            return f"{self._prefix} {_decode(text)}{_ERASE_TO_END}{_decode(segment[-end:])}"
        return self._end_line(text)

    def _draw(self, content: bytes, errors: str = "replace") -> str:
        """``content`` drawn over the current line of a terminal, the cursor back at its start."""
        if not content:
            return "\r"  # a bare "\r" (tqdm starts each redraw with one) changes nothing
        if not content.strip():
            return f"{_ERASE_TO_END}\r"  # a cleared line stays clear: no prefix on it
        return f"{self._prefix} {content.decode('utf-8', errors=errors)}{_ERASE_TO_END}\r"

    def _redraw(self, content: bytes) -> str:
        if self._terminal:
            drawn, self._drawn = self._drawn, None
            return "" if content and content == drawn else self._draw(content)
        if not content:
            return ""  # a bare "\r" changes nothing on the line
        now = self._clock()
        if self._update is None:
            self._since = now
        self._update = content = content.rstrip()
        if content and content != self._shown and now - self._since >= self._interval:
            self._since, self._shown = now, content
            return self._line(content)
        return ""

    def _end_line(self, text: bytes) -> str:
        update, shown = self._update, self._shown
        self._update = self._shown = None
        if update is None:
            return self._line(text)  # a plain line, written as it came
        if text:  # written after the last "\r": the last update
            update = text.rstrip()
        if not update or update == shown:
            return ""  # a cleared bar, or one already written as it ended
        return self._line(update)

    def _line(self, text: bytes) -> str:
        return f"{self._prefix} {_decode(text)}\n"


def _decode(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")
