"""The worker group's plumbing, shared by batch reductions and gradient buckets.

One object per worker group: it waits on collectives with the group's timeout and
turns their failures into ``PeerLostError`` naming the lost task; runs the small
integer collectives the transports coordinate with (all-gather, min, broadcast, a
barrier); and checks, before every batch reduction, that all workers make the same
call: the same tensors' shapes and dtypes, the same reduce op, and the same position
in the group's sequence of checked calls. A mismatch raises ``CollectiveMismatchError``
on every worker instead of pairing unrelated calls (wrong numbers, or gloo aborting the
process on mismatched sizes).
"""

from __future__ import annotations

import array
import datetime
import os
import sys
import typing
import zlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from unison._collectives.group.process_group import LazyWorkerGroup, WorkerGroup
from unison.errors import CollectiveMismatchError

__all__ = ["WorkerControl", "SignatureMeeting", "layout_crc", "call_site"]

# The directory of the ``unison`` package (this file is unison/_collectives/group/worker_control.py):
# call_site skips every frame inside it.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep

_DTYPE_CODES: dict[torch.dtype, int] = {}  # a dtype's CRC, the same in every process
_OP_CODES: dict[str, int] = {}


class SignatureMeeting(typing.Protocol):
    """Where the workers of a group compare a call's signature without a collective (one host's
    shared counters, ``shm_signals.SharedSignals``)."""

    def same_signature(self, signature: Sequence[int], turn: int) -> bool:
        """Whether every worker came with ``signature``; the same answer on every worker.

        Raises:
            RuntimeError: a worker died or did not come within the group's timeout.
        """
        ...


def _code(table: dict, key: Any, text: str) -> int:
    code = table.get(key)
    if code is None:
        code = table[key] = zlib.crc32(text.encode())
    return code


def layout_crc(tensors: Sequence[torch.Tensor]) -> int:
    """A CRC of every tensor's dtype, layout and shape: equal on every worker iff (almost surely) they agree."""
    words: list[int] = []
    for t in tensors:
        shape = t.shape
        words.append(_code(_DTYPE_CODES, t.dtype, str(t.dtype)))
        words.append(len(shape) if t.layout == torch.strided else -1 - len(shape))
        words.extend(shape)
    return zlib.crc32(array.array("q", words).tobytes())


def call_site() -> tuple[str, int]:
    """``(file, line)`` of the innermost frame outside unison: where the user made this call."""
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame = frame.f_back
    return frame.f_code.co_filename, frame.f_lineno


def _describe_layout(tensors: Sequence[torch.Tensor]) -> str:
    return repr([(tuple(t.shape), str(t.dtype), t.layout == torch.strided) for t in tensors])


@typing.final
class WorkerControl:
    """Waits, control collectives and the per-call check of one worker group.

    Args:
        group: the group, or a lazy group formed on first use.
        device: the device of the group's tensors (the CPU for gloo, the replica's GPU for NCCL).
    """

    def __init__(self, group: WorkerGroup | LazyWorkerGroup, device: torch.device):
        self._source = group
        self.device = device
        self._sequence = 0  # checked calls made so far by this worker on this group

    @property
    def group(self) -> WorkerGroup:
        """The formed group (formed now if needed)."""
        source = self._source
        return source.get() if isinstance(source, LazyWorkerGroup) else source

    @property
    def rank(self) -> int:
        """This worker's rank (known before the group forms)."""
        return self._source.rank

    @property
    def world_size(self) -> int:
        """Workers in the group (known before the group forms)."""
        return self._source.world_size

    # -- waiting ---------------------------------------------------------------------------
    def launch(self, operation: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Starts ``fn(*args, group=..., async_op=True, **kwargs)``; returns its work handle."""
        group = self.group
        try:
            return fn(*args, group=group.group, async_op=True, **kwargs)
        except Exception as exc:  # noqa: BLE001 - gloo/NCCL raise RuntimeError subclasses
            raise group.lost_peer_error(operation, exc) from exc

    def wait(self, work: Any, operation: str) -> None:
        """Waits for ``work`` within the group's timeout; a failure names the lost task.

        On NCCL the wait is the stream's, not the host's: a timeout given to an NCCL
        work's ``wait`` blocks this thread until the GPU has finished everything queued
        before the collective, which stalls every step; the group's own timeout (its
        watchdog) still ends a collective that a lost peer never joins.
        """
        group = self.group
        try:
            if group.backend == "nccl":
                work.wait()
            else:
                work.wait(datetime.timedelta(seconds=group.timeout))
        except Exception as exc:  # noqa: BLE001
            raise group.lost_peer_error(operation, exc) from exc

    def call(self, operation: str, fn: Any, *args: Any, **kwargs: Any) -> None:
        """Runs one collective to completion."""
        self.wait(self.launch(operation, fn, *args, **kwargs), operation)

    # -- control collectives -------------------------------------------------------------
    def all_gather_ints(self, values: list[int], operation: str) -> list[list[int]]:
        """Every worker's list of ints (all of the same length), by rank."""
        mine = torch.tensor(values, dtype=torch.int64, device=self.device)
        gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
        self.call(operation, dist.all_gather, gathered, mine)
        return [g.tolist() for g in gathered]

    def agree_min(self, value: int, operation: str) -> int:
        """The smallest of every worker's ``value``."""
        return self.agree_min_each([value], operation)[0]

    def agree_min_each(self, values: list[int], operation: str) -> list[int]:
        """For each position of ``values`` (the same length on every worker), the smallest worker's value."""
        if not values:
            return []
        flags = torch.tensor(values, dtype=torch.int64, device=self.device)
        self.call(operation, dist.all_reduce, flags, op=dist.ReduceOp.MIN)
        return flags.tolist()

    def broadcast_ints(self, values: list[int], operation: str) -> list[int]:
        """Worker 0's list of ints, on every worker."""
        payload = torch.tensor(values, dtype=torch.int64, device=self.device)
        self.call(operation, dist.broadcast, payload, group_src=0)  # rank 0 of this group
        return payload.tolist()

    def barrier(self, operation: str = "barrier") -> None:
        """Waits until every worker arrives (an all-reduce of one element)."""
        self.agree_min(1, operation)

    # -- the per-call check ----------------------------------------------------------------
    def check_call(self, tensors: Sequence[torch.Tensor], operation: str, reduce_op: str = "",
                   signals: SignatureMeeting | None = None) -> None:
        """Raises CollectiveMismatchError on every worker unless all make the same call.

        Compares five integers: the tensors' count, a CRC of their
        layouts, the reduce op, this call's number in the group's sequence of checked
        calls, and a CRC of the call site (the user's file and line that made the call).
        ``signals`` (the group's workers all on one host, sharing counters): compared there
        first, a store and a barrier; where they differ, every worker sees it and all go on to
        the all-gather, whose signatures name what differs. None: one all-gather of them
        (gloo's loop thread and a TCP round trip: 0.42 ms and 0.27 ms of CPU a rank, alone).
        The call site catches a worker that skipped a call: both workers' counters move
        on together, so without it a skipped reduce pairs the next one with the peer's
        skipped one and returns wrong sums. It runs on every call, not only on a
        layout's first: a worker that skipped it while a peer checked would pair a data
        all-reduce with the peer's all-gather, and gloo aborts the process on such a
        size mismatch.
        """
        self._sequence += 1
        filename, line = call_site()
        site = zlib.crc32(f"{os.path.basename(filename)}:{line}".encode())
        mine = [len(tensors), layout_crc(tensors), _code(_OP_CODES, reduce_op, reduce_op), self._sequence, site]
        if signals is not None:
            try:
                same = signals.same_signature(mine, self._sequence)
            except RuntimeError as exc:  # a peer died or timed out: named as the all-gather would
                raise self.group.lost_peer_error(f"{operation} (layout check)", exc) from exc
            if same:
                return
        signatures = self.all_gather_ints(mine, f"{operation} (layout check)")
        if any(s != signatures[0] for s in signatures):
            self._raise_mismatch(signatures, mine, tensors, operation, reduce_op, f"{filename}:{line}")

    def _raise_mismatch(self, signatures: list[list[int]], mine: list[int], tensors: Sequence[torch.Tensor],
                        operation: str, reduce_op: str, site: str) -> typing.NoReturn:
        names = self.group.names
        me = names[self.rank]
        if any(s[4] != mine[4] for s in signatures):
            differing = [names[r] for r, s in enumerate(signatures) if s[4] != mine[4]]
            raise CollectiveMismatchError(
                f"{operation}: the workers' call sequences differ: {me} makes call #{mine[3]} on the group from "
                f"{site}, and {differing} make theirs from another line; a worker skipped or added a collective "
                f"(a reduce, all_reduce or gather made by one worker only, e.g. `strategy.reduce` for logging on "
                f"the chief alone). Every worker must make the same collective calls, from the same lines, in "
                f"the same order (to reduce on every worker and print on one, reduce before the `if`)"
            )
        if any(s[3] != mine[3] for s in signatures):
            calls = {names[r]: s[3] for r, s in enumerate(signatures)}
            raise CollectiveMismatchError(
                f"{operation}: the workers' call sequences differ: this is call #{mine[3]} of {me} on the group, "
                f"but the workers are at calls {calls}; a worker skipped or added a collective (a reduce, "
                f"all_reduce or gather made by one worker only, e.g. `strategy.reduce` for logging on the chief "
                f"alone). Every worker must make the same collective calls in the same order"
            )
        if any(s[2] != mine[2] for s in signatures):
            differing = [names[r] for r, s in enumerate(signatures) if s[2] != mine[2]]
            raise CollectiveMismatchError(
                f"{operation}: workers passed different reduce ops: this worker ({me}) reduces with "
                f"{reduce_op!r}, and {differing} use another; every worker must pass the same ReduceOp"
            )
        differing = [names[r] for r, s in enumerate(signatures) if s != mine]
        raise CollectiveMismatchError(
            f"{operation}: workers passed tensors of different shapes or dtypes; this worker "
            f"({me}) has {_describe_layout(tensors)}, and {differing} differ. Every "
            f"worker must reduce the same tensors in the same order"
        )
