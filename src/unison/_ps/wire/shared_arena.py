"""Same-host tensor exchange: a worker's memory that the ps tasks on its host map too.

A pull or push over a socket copies every byte three times on one host (into the
kernel, out of it, and on the ps into or out of its variable) and costs the ps most of
its CPU time. When a worker and a ps task share a host, the worker keeps its cached
parameters and a gradient slot per variable in an :class:`SharedArena`: anonymous
memory files (``memfd_create``) that the ps task opens through
``/proc/<worker pid>/fd/<fd>``. The request still travels over the socket (so a ps that
dies is still an error naming ``ps:K``, and a worker that dies just ends its session),
but it names ``(segment, offset)`` places instead of carrying bytes: a pull is one copy
on the ps, from its variable into the worker's parameter under the variable's lock; a
push is one copy on the worker, of the gradient into its slot, and the ps applies its
optimizer from there.

No file is ever named in ``/dev/shm``: the memory goes away with the last process that
maps it, even after a SIGKILL. Each segment starts with a random token that the ps
checks after opening it, so a worker on another host (another process behind the same
pid) is never mistaken for a local one: the ps says no and the worker keeps sockets.

tf.distribute has no equivalent (its gRPC runtime copies on one host too).
"""

from __future__ import annotations

import math
import mmap
import os
import secrets
import stat
import threading
from typing import final

import torch

__all__ = ["SharedArena", "SegmentInfo", "Place", "MappedSegments"]

#: (token hex, pid, fd, size in bytes): how a ps task opens a worker's segment.
SegmentInfo = tuple[str, int, int, int]
#: (token hex, byte offset, shape, dtype): a tensor inside a segment.
Place = tuple[str, int, tuple, torch.dtype]

_TOKEN_BYTES = 16
_ALIGN = 64
_MIN_SEGMENT = 16 << 20


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _own_tensor(data: torch.Tensor, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The contiguous ``shape``/``dtype`` tensor at byte ``offset`` of the bytes ``data``, with
    its own autograd version counter.

    A view (``data[a:b].view(dtype)``) would share ``data``'s counter with every other
    tensor of the segment: an in-place write to one (BatchNorm's running statistics in
    forward) would then look to autograd like a write to all of them, and backward would
    refuse a weight it saved ("modified by an inplace operation"). ``set_`` onto the
    storage makes a tensor that is no view: its version moves only when it is written.
    """
    if offset % dtype.itemsize:
        raise ValueError(f"offset {offset} is not a multiple of {dtype}'s size {dtype.itemsize}")
    # The empty stride (): contiguous.
    return torch.empty(0, dtype=dtype).set_(data.untyped_storage(), offset // dtype.itemsize, shape, ())


@final
class _Segment:
    """One memory file, mapped, with a bump allocator."""

    def __init__(self, size: int):
        self.token = secrets.token_bytes(_TOKEN_BYTES)
        self.fd = os.memfd_create("unison-ps-arena", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self.map = mmap.mmap(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise
        self.map[:_TOKEN_BYTES] = self.token
        self.size = size
        self.used = _ALIGN
        self.bytes = torch.frombuffer(self.map, dtype=torch.uint8)
        self.info: SegmentInfo = (self.token.hex(), os.getpid(), self.fd, size)

    def take(self, nbytes: int) -> int | None:
        if self.used + nbytes > self.size:
            return None
        offset, self.used = self.used, self.used + _aligned(nbytes)
        return offset


@final
class SharedArena:
    """A worker's shared memory for ps traffic: tensors allocated here can be named in requests.

    ``tensor(shape, dtype)`` allocates (never frees: a worker's ps variables live as
    long as it does); ``place(tensor)`` says where a tensor of this arena lies, or None.
    """

    def __init__(self) -> None:
        self._segments: list[_Segment] = []
        self._lock = threading.Lock()

    @staticmethod
    def available() -> bool:
        """Whether this platform has anonymous memory files and ``/proc``."""
        return hasattr(os, "memfd_create") and os.path.isdir(f"/proc/{os.getpid()}/fd")

    def tensor(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A new tensor (zeros) in shared memory, not a view: it has its own autograd version counter."""
        numel = math.prod(shape)
        nbytes = max(numel * dtype.itemsize, 1)
        with self._lock:
            segment, offset = None, None
            if self._segments:
                segment = self._segments[-1]
                offset = segment.take(nbytes)
            if offset is None:
                segment = _Segment(max(_MIN_SEGMENT, _aligned(nbytes) + _ALIGN))
                self._segments.append(segment)
                offset = segment.take(nbytes)
        assert segment is not None and offset is not None
        return _own_tensor(segment.bytes, offset, tuple(shape), dtype)

    def segments(self) -> list[SegmentInfo]:
        """Every segment's opening information."""
        with self._lock:
            return [s.info for s in self._segments]

    def place(self, tensor: torch.Tensor) -> Place | None:
        """Where ``tensor`` (contiguous) lies in this arena, or None if it is not here."""
        if not tensor.is_contiguous() or tensor.device.type != "cpu":
            return None
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        for segment in self._segments:
            base = segment.bytes.data_ptr()
            if base <= start and end <= base + segment.size:
                return (segment.info[0], start - base, tuple(tensor.shape), tensor.dtype)
        return None

    def close(self) -> None:
        """Unmaps and closes every segment (tensors of this arena must be unused)."""
        with self._lock:
            segments, self._segments = self._segments, []
        for segment in segments:
            del segment.bytes
            try:
                segment.map.close()
            except BufferError:  # a tensor still views it: the mapping goes with the process
                pass
            os.close(segment.fd)


@final
class MappedSegments:
    """The ps side: a session's view of one worker's segments."""

    def __init__(self) -> None:
        self._maps: dict[str, tuple[mmap.mmap, torch.Tensor]] = {}

    def attach(self, infos: list[SegmentInfo]) -> bool:
        """Maps every segment not mapped yet; False if one cannot be opened or is not the worker's
        (another host, another pid namespace): the worker then keeps to sockets."""
        for token, pid, fd, size in infos:
            if token in self._maps:
                continue
            path = f"/proc/{pid}/fd/{fd}"
            try:  # only a regular file of the announced size: never open another process's tty or pipe
                found = os.stat(path)
                if not stat.S_ISREG(found.st_mode) or found.st_size != size:
                    return False
                handle = os.open(path, os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)
            except OSError:
                return False
            try:
                if os.fstat(handle).st_size != size:
                    return False
                mapped = mmap.mmap(handle, size)
            except (OSError, ValueError):
                return False
            finally:
                os.close(handle)
            if bytes(mapped[:_TOKEN_BYTES]) != bytes.fromhex(token):
                mapped.close()
                return False
            self._maps[token] = (mapped, torch.frombuffer(mapped, dtype=torch.uint8))
        return True

    def tensor(self, place: Place) -> torch.Tensor:
        """The worker's tensor at ``place``.

        Raises:
            KeyError / ValueError: for a segment not attached or a place outside it.
        """
        token, offset, shape, dtype = place
        mapped, data = self._maps[token]
        end = offset + math.prod(shape) * dtype.itemsize
        if offset < _TOKEN_BYTES or end > len(mapped):
            raise ValueError(f"place {offset}..{end} is outside the worker's segment of {len(mapped)} bytes")
        return _own_tensor(data, offset, tuple(shape), dtype)

    def close(self) -> None:
        """Unmaps every segment (no tensor of this object may be in use)."""
        while self._maps:
            _, (mapped, data) = self._maps.popitem()
            del data  # the last view of the mapping: close() may unmap it now
            try:
                mapped.close()
            except BufferError:  # a tensor of it is still referenced: unmapped when that goes
                pass
