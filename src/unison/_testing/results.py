"""What worker processes did, and the errors that report it to a test.

:class:`WorkerFailure` derives from ``AssertionError`` so pytest reports a failed worker
as a test failure (with the rank's own traceback in the message), not as an error in
the harness.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

__all__ = ["WorkerResult", "WorkerFailure", "WorkerTimeout"]

# How much of a failed rank's captured stderr goes into an error message.
_STDERR_TAIL_CHARS = 3000


@dataclasses.dataclass(frozen=True)
class WorkerResult:
    """The outcome of one worker process.

    Attributes:
        rank: The worker's rank, ``0 .. world_size - 1``.
        exitcode: The process's exit status: 0 after a clean exit, 1 after ``fn``
            raised, ``-N`` when it was killed by signal ``N`` (``-9``: SIGKILL); None
            for a pool member, which stays alive between calls.
        value: What ``fn`` returned; None when it did not return.
        error: None when the rank succeeded; otherwise what went wrong: the rank's
            traceback, how the process ended, or its stack when it was stopped.
        stderr: What the process wrote to stderr during the call.
    """

    rank: int
    exitcode: int | None
    value: Any = None
    error: str | None = None
    stderr: str = ""

    @property
    def ok(self) -> bool:
        """True when ``fn`` returned and the process ended cleanly."""
        return self.error is None


class WorkerFailure(AssertionError):
    """One or more worker processes failed.

    Attributes:
        results: One :class:`WorkerResult` per rank, in rank order.
        failed_ranks: The ranks whose result is not ``ok``.
    """

    def __init__(self, results: Sequence[WorkerResult], headline: str | None = None) -> None:
        self.results = tuple(results)
        self.failed_ranks = tuple(r.rank for r in self.results if not r.ok)
        if headline is None:
            headline = (
                f"worker rank(s) {list(self.failed_ranks)} of world_size "
                f"{len(self.results)} failed"
            )
        self.headline = headline
        super().__init__(format_results(headline, self.results))

    def __reduce__(self) -> tuple[Any, ...]:
        # The default reduce would call __init__(message); rebuild from the fields.
        return (type(self), (self.results, self.headline))


class WorkerTimeout(WorkerFailure, TimeoutError):
    """Worker processes were still running when the time limit ran out.

    The message names the ranks still running and shows each one's stack, dumped by
    ``faulthandler`` just before the process was killed.
    """


def format_results(headline: str, results: Sequence[WorkerResult]) -> str:
    """Formats the failed ranks of ``results`` under ``headline``.

    Args:
        headline: The first line of the message.
        results: Every rank's result; only failed ranks are shown in full.

    Returns:
        A multi-line message: per failed rank, its error and the tail of its stderr.
    """
    lines = [headline]
    for result in results:
        if result.ok:
            continue
        code = "alive" if result.exitcode is None else f"exit code {result.exitcode}"
        lines.append(f"===== rank {result.rank} ({code}) =====")
        lines.append((result.error or "").rstrip())
        stderr = result.stderr.strip()
        if stderr:
            if len(stderr) > _STDERR_TAIL_CHARS:
                stderr = "..." + stderr[-_STDERR_TAIL_CHARS:]
            lines.append(f"----- rank {result.rank} stderr -----")
            lines.append(stderr)
    return "\n".join(lines)
