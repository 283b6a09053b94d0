"""Heartbeats through the rendezvous store, to name the peers that vanished.

When a collective fails (a peer crashed, or did not answer within the timeout), the
error should say *which* task is gone. Every worker bumps a counter in the store every
``interval`` seconds from a daemon thread; after a failure, the workers whose counters
stop moving are the missing ones. If the store itself is gone, its host (the
collective leader) is the one missing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import torch.distributed as dist

__all__ = ["Liveness"]


class Liveness:
    """Publishes this worker's heartbeat and finds peers whose heartbeat stopped."""

    def __init__(self, store: dist.Store, rank: int, task_names: Sequence[str], interval: float = 0.5):
        self._store = store
        self._rank = rank
        self._names = list(task_names)
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"unison-heartbeat-{rank}", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        key = f"heartbeat/{self._rank}"
        while not self._stop.is_set():
            try:
                self._store.add(key, 1)
            except Exception:  # noqa: BLE001 - the store host is gone; missing() reports it
                return
            self._stop.wait(self._interval)

    def _counters(self) -> list[int] | None:
        try:
            return [self._store.add(f"heartbeat/{r}", 0) for r in range(len(self._names))]
        except Exception:  # noqa: BLE001
            return None

    def missing(self, window: float | None = None) -> list[str]:
        """Names of the tasks whose heartbeat did not advance within ``window`` seconds."""
        window = window if window is not None else 4 * self._interval
        before = self._counters()
        if before is None:
            return [self._names[0]]
        deadline = time.monotonic() + window
        alive = {self._rank}
        while time.monotonic() < deadline and len(alive) < len(self._names):
            time.sleep(self._interval / 2)
            after = self._counters()
            if after is None:
                return [self._names[0]]
            alive |= {r for r, (a, b) in enumerate(zip(before, after)) if b > a}
        return [name for r, name in enumerate(self._names) if r not in alive]

    def stop(self, timeout: float = 2.0) -> None:
        """Stops the heartbeat thread and waits up to ``timeout`` seconds for it to end."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
