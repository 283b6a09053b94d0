"""Where a local job's CPU goes: each task's CPU seconds, in all and over the timed phase.

Runs a command (usually ``python -m unison.launch ...``), reads every process of its tree
from ``/proc`` every ``--period`` seconds, and names each by the task its ``TF_CONFIG``
gives (``worker:0``, ``ps:1``; the launcher and other processes by their command line).
A job on a small machine is CPU-bound: its speed is the CPU its tasks need, so this says
what each role costs (the hybrid DLRM's ps tasks beside its workers, for instance) where
a profile of one process cannot.

The timed phase: ``--phase REGEX`` matches the output line that ends it, and the regex's
first group is the phase's length in seconds (the default matches ``examples/ctr.py``'s
"trained on N samples ... in 9.1 s"). Each task's CPU over the phase is read off its
samples (interpolated), beside the phase's capacity (usable cores x seconds).

Usage:
    python benchmarks/task_cpu.py [--period 0.25] [--phase REGEX] [--json FILE] -- \\
        python -m unison.launch --workers 2 --ps 2 examples/ctr.py --train 200000

Linux only (``/proc``). Run it on a quiet machine: the other processes' CPU is not counted,
but they slow the job's.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info  # noqa: E402

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
DEFAULT_PHASE = r"in ([0-9.]+) s \("


def _stat(pid: int) -> tuple[int, float, float] | None:
    """``(parent pid, user s, system s)`` of a process, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), int(fields[11]) / _TICKS, int(fields[12]) / _TICKS


def _label(pid: int) -> tuple[str, bool]:
    """The task ``TF_CONFIG`` names (``worker:0``) and True, else the start of the command line and
    False (a process forked but not yet exec'd shows its parent's: read it again later)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        if b"TF_CONFIG" in environ:
            task = json.loads(environ[b"TF_CONFIG"])["task"]
            return f"{task['type']}:{task['index']}", True
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:60] or f"pid {pid}", False
    except (OSError, ValueError, KeyError):
        return f"pid {pid}", False


def _descendants(root: int) -> dict[int, tuple[float, float]]:
    """CPU ``(user, system)`` seconds of ``root`` and every process below it, by pid."""
    parents: dict[int, int] = {}
    cpu: dict[int, tuple[float, float]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None:
                parents[int(entry)] = stat[0]
                cpu[int(entry)] = stat[1:]
    tree, frontier = {root}, [root]
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    while frontier:
        for child in children.get(frontier.pop(), []):
            if child not in tree:
                tree.add(child)
                frontier.append(child)
    return {pid: cpu[pid] for pid in tree if pid in cpu}


def _cpu_at(samples: list[tuple[float, float]], when: float) -> float:
    """A task's CPU seconds at time ``when``, interpolated between its samples ``(time, cpu)``."""
    times = [t for t, _ in samples]
    k = bisect.bisect_left(times, when)
    if k == 0:
        return samples[0][1] if when >= times[0] else 0.0
    if k == len(samples):
        return samples[-1][1]
    (t0, c0), (t1, c1) = samples[k - 1], samples[k]
    return c0 + (c1 - c0) * (when - t0) / (t1 - t0)


def measure(command: list[str], period: float, phase: str) -> dict[str, Any]:
    """Runs ``command`` and returns each task's CPU, the phase and the command's output tail."""
    start = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: lines.extend((time.monotonic() - start, line) for line in proc.stdout),
                              daemon=True)
    reader.start()
    samples: dict[int, list[tuple[float, float, float]]] = {}
    labels: dict[int, str] = {}
    named: set[int] = set()  # pids whose TF_CONFIG named them: their label is final
    while proc.poll() is None:
        now = time.monotonic() - start
        for pid, (user, system) in _descendants(proc.pid).items():
            if pid not in named:
                labels[pid], final = _label(pid)
                if final:
                    named.add(pid)
            samples.setdefault(pid, []).append((now, user, system))
        time.sleep(period)
    reader.join(timeout=5)
    phase_end = phase_seconds = None
    for at, line in lines:
        match = re.search(phase, line)
        if match:
            phase_end, phase_seconds = at, float(match.group(1))
    tasks: dict[str, dict[str, float]] = {}
    for pid, rows in samples.items():
        name = labels[pid] if labels[pid] not in tasks else f"{labels[pid]} (pid {pid})"
        user, system = rows[-1][1], rows[-1][2]
        task = {"cpu_s": round(user + system, 2), "user_s": round(user, 2), "system_s": round(system, 2)}
        if phase_end is not None and phase_seconds is not None:
            series = [(t, u + s) for t, u, s in rows]
            task["phase_cpu_s"] = round(_cpu_at(series, phase_end) - _cpu_at(series, phase_end - phase_seconds), 2)
        tasks[name] = task
    machine = machine_info()  # its load average is the job's own, read as it ends
    cores = machine["usable_cores"]
    out: dict[str, Any] = {"command": command, "returncode": proc.returncode, "machine": machine,
                           "wall_s": round(time.monotonic() - start, 1), "tasks": tasks,
                           "output_tail": [line.rstrip() for _, line in lines[-4:]]}
    if phase_seconds is not None:
        used = sum(task.get("phase_cpu_s", 0.0) for task in tasks.values())
        out["phase"] = {"seconds": phase_seconds, "capacity_cpu_s": round(cores * phase_seconds, 2),
                        "used_cpu_s": round(used, 2), "busy": round(used / (cores * phase_seconds), 3)}
    return out


def report(result: dict[str, Any]) -> str:
    """The result as a table: each task's CPU, and its share of the phase's CPU."""
    phase = result.get("phase")
    lines = [f"{'task':<28} {'cpu s':>7} {'user':>7} {'sys':>6}" + (f" {'in phase':>9} {'share':>6}" if phase else "")]
    for name, task in sorted(result["tasks"].items(), key=lambda item: -item[1]["cpu_s"]):
        row = f"{name:<28} {task['cpu_s']:>7.2f} {task['user_s']:>7.2f} {task['system_s']:>6.2f}"
        if phase and "phase_cpu_s" in task:
            row += f" {task['phase_cpu_s']:>9.2f} {task['phase_cpu_s'] / max(phase['used_cpu_s'], 1e-9):>6.1%}"
        lines.append(row)
    if phase:
        cores = result["machine"]["usable_cores"]
        lines.append(f"phase: {phase['seconds']} s on {cores} cores = {phase['capacity_cpu_s']} CPU s; "
                     f"the tasks used {phase['used_cpu_s']} ({phase['busy']:.0%} busy)")
    else:
        lines.append("phase: no output line matched --phase; totals only")
    load = [round(x, 2) for x in result["machine"]["load_average_1_5_15"] or []]
    lines.append(f"wall {result['wall_s']} s, exit {result['returncode']}, load average after {load}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--period", type=float, default=0.25, help="seconds between readings (default 0.25)")
    parser.add_argument("--phase", default=DEFAULT_PHASE,
                        help="regex of the line that ends the timed phase; group 1: its seconds")
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --, e.g. -- python -m unison.launch --workers 2 ...")
    if not os.path.isdir("/proc/self"):
        parser.error("task_cpu.py reads /proc: Linux only")
    if args.period <= 0:
        parser.error(f"--period must be > 0 seconds, got {args.period}")
    result = measure(command, args.period, args.phase)
    print("\n".join(result["output_tail"]))
    print(report(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return 0 if result["returncode"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
