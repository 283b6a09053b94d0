"""Worker functions for the exit-release tests (module level, so spawned processes import them)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from tests.multi_worker._workers import strategy_for
from unison._collectives.group.process_group import release_worker_group
from unison._collectives.group.worker_control import WorkerControl
from unison._collectives.transport.host_share import HostsShare


def _gloo_threads() -> int:
    """gloo's threads in this process (its work loops and its socket loop), by their kernel names."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                names.append(comm.read().strip())
        except OSError:
            continue  # ended meanwhile
    return sum(name.startswith(("pt_gloo", "gloo")) for name in names)


def user_destroys_then_unison_releases(rank: int, world: int, with_subgroups: bool):
    """Trains on the gloo group (and, asked, forms per-"host" subgroups), destroys the default
    group as a user's script would, then runs unison's exit release; counts gloo's threads."""
    del os.posix_fallocate  # this fresh process's own: shared memory is refused, every byte goes over gloo
    strategy = strategy_for(rank, world)
    with strategy.scope():
        model = torch.nn.Linear(8, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.zero_grad()
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    group = strategy.extended.cross_device_ops.transport._control.group
    if with_subgroups:  # each worker its own "host"
        share = HostsShare(WorkerControl(group, torch.device("cpu")), [f"host-{r}" for r in range(world)])
        _ = share.slices_cross_hosts  # forms the groups: each host's, and one of the hosts' leaders
    dist.destroy_process_group()  # the user's, before unison's atexit handler
    after_user = _gloo_threads()
    release_worker_group(group)
    return {
        "fell_back": not strategy.extended.cross_device_ops.transport.shared_memory.available,
        "subgroups": len(group.subgroups),
        "gloo_threads_after_user_destroy": after_user,
        "gloo_threads_after_release": _gloo_threads(),
        "handles_dropped": group.group is None and all(sub.group is None for sub in group.subgroups),
    }
