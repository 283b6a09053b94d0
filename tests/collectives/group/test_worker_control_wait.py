"""How WorkerControl waits for a collective: the host waits on gloo, the stream on NCCL."""

from __future__ import annotations

import pytest
import torch

from unison._collectives.group.process_group import WorkerGroup
from unison._collectives.group.worker_control import WorkerControl
from unison.errors import PeerLostError

pytestmark = pytest.mark.timeout(30)


class RecordedWork:
    """A collective's work handle that records how it was waited for."""

    def __init__(self, fails: bool = False) -> None:
        self.calls: list[tuple] = []
        self._fails = fails

    def wait(self, *args) -> bool:
        self.calls.append(args)
        if self._fails:
            raise RuntimeError("connection closed by peer")
        return True


def _control(backend: str) -> WorkerControl:
    group = WorkerGroup(None, None, 0, 2, ["worker:0", "worker:1"], backend, 7.0, None)
    return WorkerControl(group, torch.device("cpu"))


def test_gloo_waits_on_the_host_within_the_groups_timeout():
    work = RecordedWork()
    _control("gloo").wait(work, "all-reduce")
    assert [a[0].total_seconds() for a in work.calls] == [7.0]


def test_nccl_waits_on_the_stream_so_the_host_goes_on():
    """A timeout would make NCCL block the host until the GPU is done: no overlap."""
    work = RecordedWork()
    _control("nccl").wait(work, "all-reduce")
    assert work.calls == [()]


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_a_failed_wait_names_the_operation(backend):
    with pytest.raises(PeerLostError, match=r"all-reduce"):
        _control(backend).wait(RecordedWork(fails=True), "all-reduce")
