"""What the workers of a host share to sum gradient buckets: the shared files and the signals between them.

A cross-worker transport (``cross_worker.py``) makes one of these and hands it, at
construction, both to its own batch all-reduce and to the bucket transport it names
(``shared_buckets.py``): the bucket transport announces a written slot and completes the
sums through it, never by calling back the transport that built it.

- :class:`OneHostShare`: every worker on one host: a shared counter (else a tiny
  all-reduce) says a slot is written, one more wait says every slice is summed;
- :class:`HostsShare`: several hosts: each host's workers share files, and each host's
  sums are added across hosts, slice by slice by the workers of one local rank on every
  host (equal hosts: "columns"), else whole by one leader per host. Given a
  :class:`~unison._collectives.transport.compression.Compressor` (bf16 / fp16), the hop
  between hosts carries the host sums in the half type: the network is where
  compression pays, while the sums within a host stay exact (shared memory has no wire).

The shared-memory engine of either is made on first use, when the group has formed.
"""

from __future__ import annotations

import datetime
import time
import typing
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from unison._collectives.group.process_group import WorkerGroup
from unison._collectives.group.worker_control import WorkerControl
from unison._collectives.transport.compression import Compressor
from unison._collectives.transport.shared_memory import SharedMemoryAllReduce, SharedSegment
from unison._collectives.transport.shm_signals import WRITTEN

__all__ = ["OneHostShare", "HostsShare", "BATCH_OPERATION", "BUCKETS_OPERATION"]

LINK_PROBE_BYTES = 1 << 20
"""What one probe of the link between hosts sends (:meth:`HostsShare.link_bytes_per_second`)."""

BATCH_OPERATION = "batch all-reduce"
"""How a failed batch all-reduce is named in errors."""

BUCKETS_OPERATION = "gradient all-reduce"
"""How a failed gradient bucket's trip is named in errors."""


class _Posted:
    """A work handle for 'every worker of the host posted this bucket': waits on the shared counters."""

    def __init__(self, engine: SharedMemoryAllReduce, count: int):
        self._engine, self._count = engine, count

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        signals = self._engine.signals
        assert signals is not None
        signals.wait(WRITTEN, self._count, timeout.total_seconds() if timeout is not None else None)
        return True

    def is_completed(self) -> bool:
        """Whether every worker of the host posted this bucket (without waiting), as a work's ``is_completed``."""
        signals = self._engine.signals
        assert signals is not None
        return signals.reached(WRITTEN, self._count)


class _Trip:
    """One tensor's all-reduce between hosts, exact: the sum lands in the tensor itself."""

    def __init__(self, across: WorkerControl, tensor: torch.Tensor):
        self._across = across
        self._work = across.launch(BATCH_OPERATION, dist.all_reduce, tensor)

    def finish(self) -> None:
        self._across.wait(self._work, f"{BATCH_OPERATION} (between hosts)")


class _CompressedTrip:
    """One tensor's all-reduce between hosts in a half type, cast back into the tensor when it lands.

    A float16 sum that overflowed is done again exactly (the tensor still holds the host's
    sum): every worker of the group between hosts holds the very same reduced wire
    tensor, so all of them take the same decision without a word.
    """

    def __init__(self, across: WorkerControl, tensor: torch.Tensor, compressor: Compressor):
        self._across, self._tensor, self._compressor = across, tensor, compressor
        self._wire = compressor.to_wire(tensor)
        self._work = across.launch(BATCH_OPERATION, dist.all_reduce, self._wire)

    def finish(self) -> None:
        operation = f"{BATCH_OPERATION} (between hosts)"
        self._across.wait(self._work, operation)
        if self._compressor.overflowed(self._wire):
            self._across.call(operation, dist.all_reduce, self._tensor)
        else:
            self._tensor.copy_(self._wire)


def _trip(across: WorkerControl, tensor: torch.Tensor, compressor: Compressor | None) -> _Trip | _CompressedTrip:
    """Starts adding ``tensor`` (a host's sum, or a slice of it) across hosts, compressed where asked and possible."""
    if compressor is not None and compressor.compresses(tensor):
        return _CompressedTrip(across, tensor, compressor)
    return _Trip(across, tensor)


def _announce(engine: SharedMemoryAllReduce, through_group: Callable[[], Any]) -> Any:
    """Says that this worker's slot of the next bucket is written: a shared counter, else a tiny collective."""
    signals = engine.signals
    if signals is None:
        return through_group()
    return _Posted(engine, signals.post(WRITTEN))


@typing.final
class OneHostShare:
    """The workers of one host: ``/dev/shm`` files between them, and the signals that a slot is written."""

    def __init__(self, control: WorkerControl):
        self._control = control
        self._engine: SharedMemoryAllReduce | None = None
        self._summed = torch.zeros(1, dtype=torch.int32)

    @property
    def shared_memory(self) -> SharedMemoryAllReduce:
        """The engine (made on first use, when the group forms)."""
        if self._engine is None:
            control = self._control
            self._engine = SharedMemoryAllReduce(
                control.rank, control.world_size, lambda: control.barrier(f"{BATCH_OPERATION} (shared memory)"),
                lambda values: control.broadcast_ints(values, "shared-memory setup"),
                lambda value: control.agree_min(value, "shared-memory setup"),
                signal_group=lambda: control.group,
            )
        return self._engine

    def announce(self, flag: torch.Tensor) -> Any:
        """A work that completes when every worker wrote its slot of the bucket ``flag`` stands for."""
        return _announce(self.shared_memory, lambda: self._control.launch(BUCKETS_OPERATION, dist.all_reduce, flag))

    def complete(self, segments: list[SharedSegment]) -> None:
        """Waits until every worker summed its slice of ``segments`` (this one summed its own)."""
        if self.shared_memory.signals is not None:
            self.shared_memory.sync(BUCKETS_OPERATION)
        else:
            self._control.call(BUCKETS_OPERATION, dist.all_reduce, self._summed)


@typing.final
class HostsShare:
    """Shared files within each host, the hosts' sums added across hosts.

    Args:
        control: the whole group's plumbing (the per-call check, the fallback agreement).
        hosts: the host of every rank (``ResolvedCluster.task_hosts``).
        compressor: where given, floating-point sums cross hosts in its half type (the
            sums within a host stay exact); None: exact everywhere.
    """

    def __init__(self, control: WorkerControl, hosts: Sequence[str], compressor: Compressor | None = None):
        self._control = control
        self._hosts = tuple(hosts)
        self.compressor = compressor
        self._engine: SharedMemoryAllReduce | None = None
        self._local: WorkerControl | None = None
        self._leaders: WorkerControl | None = None  # None on workers that do not lead their host
        self._column: WorkerControl | None = None  # this local rank on every host (equal hosts only)

    def _groups(self) -> None:
        """Forms every host's group, and the groups across hosts (collectives: every worker, same order).

        Hosts with equally many workers get one group per local rank (a "column" across
        the hosts); otherwise one group of the hosts' leaders.
        """
        group = self._control.group
        order = list(dict.fromkeys(self._hosts))  # hosts in the order of their first rank
        members = {host: [r for r, h in enumerate(self._hosts) if h == host] for host in order}
        timeout = datetime.timedelta(seconds=group.timeout)
        mine = self._hosts[group.rank]
        for host in order:
            ranks = members[host]
            handle = dist.new_group(ranks, timeout=timeout, backend=group.backend)
            if host == mine:
                self._local = WorkerControl(_subgroup(group, handle, ranks), self._control.device)
        sizes = {len(ranks) for ranks in members.values()}
        columns = ([[members[host][j] for host in order] for j in range(sizes.pop())] if len(sizes) == 1
                   else [[members[host][0] for host in order]])  # fmt: skip
        for ranks in columns:
            handle = dist.new_group(ranks, timeout=timeout, backend=group.backend)
            if group.rank in ranks:
                control = WorkerControl(_subgroup(group, handle, ranks), self._control.device)
                if len(columns) > 1:
                    self._column = control
                else:
                    self._leaders = control

    @property
    def _host(self) -> WorkerControl:
        """This host's workers' plumbing (the groups form on first use)."""
        if self._local is None:
            self._groups()
        return typing.cast(WorkerControl, self._local)  # every worker belongs to its host's group

    @property
    def shared_memory(self) -> SharedMemoryAllReduce:
        """The engine of this host's workers (made on first use, when the group forms)."""
        if self._engine is None:
            local, control = self._host, self._control
            self._engine = SharedMemoryAllReduce(
                local.rank, local.world_size, lambda: local.barrier(f"{BATCH_OPERATION} (host)"),
                lambda values: local.broadcast_ints(values, "shared-memory setup"),
                lambda value: control.agree_min(value, "shared-memory setup"),  # all hosts, or none
                after_sums=self._add_across_hosts, signal_group=lambda: local.group,
            )
        return self._engine

    @property
    def slices_cross_hosts(self) -> bool:
        """Whether each worker adds its own slice across hosts (equal hosts: columns), not leaders.

        Forms the groups on first use (a collective: every worker asks at the same point).
        """
        self._host  # noqa: B018 - the groups exist from here on
        return self._column is not None

    def link_bytes_per_second(self) -> int:
        """How fast a slice crosses hosts: bytes a second of the slowest column's all-reduce of
        ``LINK_PROBE_BYTES`` (the best of two, every column at once as the buckets' slices go),
        the same on every worker. A collective, once where the buckets are planned (equal hosts)."""
        column = self._column
        assert column is not None, "link_bytes_per_second needs equal hosts (slices_cross_hosts)"
        probe = torch.zeros(LINK_PROBE_BYTES // 4, dtype=torch.float32, device=column.device)
        column.call("link probe", dist.all_reduce, probe[:1])  # the connections, before the clock
        best = float("inf")
        for _ in range(2):
            start = time.perf_counter()
            column.call("link probe", dist.all_reduce, probe)
            best = min(best, time.perf_counter() - start)
        return self._control.agree_min(int(LINK_PROBE_BYTES / max(best, 1e-9)), "link probe")

    def start_across_hosts(self, summed: torch.Tensor) -> list[Any]:
        """Starts adding ``summed``, this worker's summed slice of a bucket, across hosts (columns only):
        the same slice of every host, all-reduced in place.

        Returns the trips under way; ``wait_across_hosts`` waits for them (and casts
        compressed ones back). The gradient buckets call it bucket by bucket while
        backward goes on, so the trip between hosts overlaps the rest of backward as
        DDP's all-reduce does.
        """
        column = self._column
        assert column is not None, "start_across_hosts needs equal hosts (slices_cross_hosts)"
        if summed.numel() == 0:
            return []
        return [_trip(column, summed, self.compressor)]

    def wait_across_hosts(self, works: list[Any]) -> None:
        """Waits for the works of ``start_across_hosts``: this worker's slices hold every host's sums."""
        self._wait_across(works)

    def sync_host(self) -> None:
        """Waits until every worker of this host is here (after each one finished its slices)."""
        self.shared_memory.sync(f"{BUCKETS_OPERATION} (host)")

    def _wait_across(self, trips: list[Any]) -> None:
        for trip in trips:  # in launch order, on every worker of the group alike
            trip.finish()

    def _add_across_hosts(self, segments: list[SharedSegment]) -> None:
        """Adds the hosts' sums (called by every worker once it summed its slices).

        Columns: this worker all-reduces its own slice of every result with the workers
        of its local rank on the other hosts. Leaders: once the host's sums are complete,
        its leader all-reduces them whole. The caller then synchronises the host.
        """
        engine, column = self.shared_memory, self._column
        if column is not None:
            parts = [engine.my_part(segment.result) for segment in segments]
            self._wait_across([work for summed in parts for work in self.start_across_hosts(summed)])
            return
        self._host  # noqa: B018 - the groups exist from here on
        engine.sync(f"{BATCH_OPERATION} (host)")
        leaders = self._leaders
        if leaders is not None:
            self._wait_across([_trip(leaders, segment.result, self.compressor) for segment in segments])

    def announce(self, flag: torch.Tensor) -> Any:
        """A work that completes when every worker of this host wrote its slot of the bucket."""
        return _announce(self.shared_memory, lambda: self._host.launch(BUCKETS_OPERATION, dist.all_reduce, flag))

    def complete(self, segments: list[SharedSegment]) -> None:
        """Adds the hosts' sums of ``segments``, then waits until every slice on this host is final."""
        self._add_across_hosts(segments)
        self.shared_memory.sync(f"{BUCKETS_OPERATION} (host)")


def _subgroup(group: WorkerGroup, handle: Any, ranks: list[int]) -> WorkerGroup:
    """A WorkerGroup for a subgroup of ``group``: its own rank, names and process group handle
    (dropped with ``group``'s at exit)."""
    sub = WorkerGroup(handle, None, ranks.index(group.rank), len(ranks), [group.names[r] for r in ranks],
                      group.backend, group.timeout, group.liveness, group.restart_advice)
    group.subgroups.append(sub)
    return sub
