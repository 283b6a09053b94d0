"""Shared-memory all-reduce pieces that need no second process: orphans and failure cleanup."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from unison.collectives import shared_memory
from unison.errors import PeerLostError


@pytest.fixture
def shm_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(shared_memory, "SHARED_MEMORY_DIR", str(tmp_path))
    return tmp_path


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _touch(directory, name: str, age_s: float) -> None:
    path = directory / name
    path.write_bytes(b"x")
    then = time.time() - age_s
    os.utime(path, (then, then))


def test_orphans_of_dead_creators_are_removed_once_old(shm_dir):
    dead, alive = _dead_pid(), os.getpid()
    old = shared_memory.ORPHAN_AGE_S + 5
    _touch(shm_dir, f"unison-{dead}-00000000000000aa", old)  # orphan
    _touch(shm_dir, f"unison-{dead}-00000000000000bb", 1.0)  # too young: maybe a live job elsewhere
    _touch(shm_dir, f"unison-{alive}-00000000000000cc", old)  # creator alive
    _touch(shm_dir, "unison-notapid-00000000000000dd", old)  # not ours
    _touch(shm_dir, "other-file", old)
    shared_memory._remove_orphans()
    assert sorted(p.name for p in shm_dir.iterdir()) == sorted([
        f"unison-{dead}-00000000000000bb", f"unison-{alive}-00000000000000cc",
        "unison-notapid-00000000000000dd", "other-file"])


def test_worker_0_unlinks_its_file_when_a_peer_is_lost_during_setup(shm_dir):
    def lost(values):
        raise PeerLostError("broadcast failed: missing task(s): worker:1")

    transport = shared_memory.SharedMemoryAllReduce(0, 2, barrier=lambda: None, broadcast_ints=lost,
                                                    agree_min=lambda value: value)
    with pytest.raises(PeerLostError, match="worker:1"):
        transport([torch.ones(10)])
    assert list(shm_dir.iterdir()) == []


def test_a_full_shared_memory_leaves_no_file_and_falls_back(shm_dir, monkeypatch, caplog):
    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shared_memory.os, "posix_fallocate", full)
    transport = shared_memory.SharedMemoryAllReduce(0, 2, barrier=lambda: None, broadcast_ints=lambda v: v,
                                                    agree_min=lambda value: value)
    assert transport([torch.ones(10)]) is None
    assert transport.available is False
    assert list(shm_dir.iterdir()) == []
    assert "No space left on device" in caplog.text


def test_a_single_worker_never_uses_shared_memory():
    transport = shared_memory.SharedMemoryAllReduce(0, 1, barrier=lambda: None, broadcast_ints=lambda v: v,
                                                    agree_min=lambda value: value)
    assert not transport.eligible([torch.ones(10)])


def test_empty_and_non_cpu_batches_are_not_eligible():
    transport = shared_memory.SharedMemoryAllReduce(0, 2, barrier=lambda: None, broadcast_ints=lambda v: v,
                                                    agree_min=lambda value: value)
    assert transport.eligible([torch.ones(3)])
    assert not transport.eligible([])
    assert not transport.eligible([torch.ones(0)])
    assert not transport.eligible([torch.ones(3, device="meta")])
