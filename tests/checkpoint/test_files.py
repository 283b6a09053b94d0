"""Checkpoint files: atomic under SIGKILL, a full disk reported, temporaries cleaned, the umask kept
(issue 17 item 5)."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import unison
from unison import load_checkpoint, save_checkpoint
from unison._checkpoint import atomic_save
from unison.errors import CheckpointError

ROOT = Path(__file__).resolve().parents[2]
BIG = 50_000_000  # float32 elements: 200 MB

WRITER = f"""
import os, sys, torch
from unison._checkpoint import atomic_save
torch.set_num_threads(1)  # no OpenMP team before a fork
big = torch.ones({BIG})
for line in sys.stdin:  # one forked writer per line: torch is imported once, not once per try
    pid = os.fork()
    if pid == 0:
        atomic_save({{"big": big, "tag": "new"}}, sys.argv[1])
        os._exit(0)
    print(pid, flush=True)
    os.waitpid(pid, 0)
    print("reaped", flush=True)
"""


def _temporaries(directory: Path) -> list[str]:
    return [name for name in os.listdir(directory) if name.endswith(".tmp")]


@pytest.mark.timeout(240)
def test_a_kill_during_a_200_mb_save_always_leaves_the_previous_checkpoint(tmp_path):
    target = tmp_path / "big.pt"
    atomic_save({"tag": "old"}, target)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    forker = subprocess.Popen([sys.executable, "-c", WRITER, str(target)], env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        for attempt in range(10):
            forker.stdin.write("save\n")
            forker.stdin.flush()
            writer = int(forker.stdout.readline())
            deadline = time.monotonic() + 60  # kill once the temporary is being written (or at once, on odd tries)
            while attempt % 2 == 0 and not _temporaries(tmp_path) and time.monotonic() < deadline:
                time.sleep(0.005)
            os.kill(writer, signal.SIGKILL)
            assert forker.stdout.readline().strip() == "reaped"
            assert load_checkpoint(target)["tag"] == "old"  # never a half-written file
    finally:
        forker.kill()
        forker.wait(timeout=30)
    atomic_save({"tag": "newer"}, target)  # the next save of this file removes what the killed writers left
    assert load_checkpoint(target)["tag"] == "newer"
    assert _temporaries(tmp_path) == []


def test_a_full_disk_is_a_clear_error_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    target = tmp_path / "model.pt"
    atomic_save({"tag": "old"}, target)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(CheckpointError, match=r"no space left on the device \(\d+ bytes free in .*\); the previous"):
        atomic_save({"tag": "new"}, target)
    monkeypatch.undo()
    assert load_checkpoint(target)["tag"] == "old"
    assert _temporaries(tmp_path) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_a_really_full_tmpfs_is_reported_with_its_path(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)]).returncode != 0:
        pytest.skip("this machine does not allow mounting a tmpfs")
    try:
        target = mount / "model.pt"
        atomic_save({"tag": "old"}, target)
        with pytest.raises(CheckpointError, match=str(target)):
            atomic_save({"big": torch.ones(1_000_000)}, target)  # 4 MB into 1 MB
        assert load_checkpoint(target)["tag"] == "old"
        assert _temporaries(mount) == []
    finally:
        subprocess.run(["umount", str(mount)])


def test_files_get_the_umask_mode_not_0600(tmp_path):
    previous = os.umask(0o022)
    try:
        atomic_save({"x": 1}, tmp_path / "a.pt")
    finally:
        os.umask(previous)
    assert (tmp_path / "a.pt").stat().st_mode & 0o777 == 0o644


def test_live_writers_temporaries_are_kept_and_dead_ones_removed(tmp_path):
    target = tmp_path / "m.pt"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".m.pt.{int(dead.stdout)}.abcd1234.tmp"
    live = tmp_path / f".m.pt.{os.getppid()}.abcd1234.tmp"
    other = tmp_path / f".other.pt.{int(dead.stdout)}.abcd1234.tmp"
    for path in (stale, live, other):
        path.write_bytes(b"partial")
    atomic_save({"x": 1}, target)
    assert not stale.exists() and live.exists() and other.exists()


def test_load_checkpoint_names_the_path_and_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at .*nothing was saved there yet"):
        load_checkpoint(tmp_path / "missing.pt")


def test_save_checkpoint_writes_on_the_chief_only(tmp_path):
    assert save_checkpoint({"x": 1}, tmp_path / "c.pt", unison.OneDeviceStrategy("cpu:0"))
    assert load_checkpoint(tmp_path / "c.pt") == {"x": 1}
    spec = unison.ClusterSpec({"worker": ["127.0.0.1:1", "127.0.0.1:2"]})
    worker1 = unison.MultiWorkerMirroredStrategy(unison.SimpleClusterResolver(spec, task_type="worker", task_id=1))
    assert not save_checkpoint({"x": 2}, tmp_path / "w.pt", worker1)
    assert not (tmp_path / "w.pt").exists()
