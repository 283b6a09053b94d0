"""The fast path of reads in a replica: each replica reads its own component, through any argument shape."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import unison
from unison._values.dispatch import is_plain_read


def test_plain_reads_are_told_from_writes():
    assert is_plain_read(torch.nn.functional.linear) and is_plain_read(torch.Tensor.t) and is_plain_read(torch.add)
    assert is_plain_read(torch.Tensor.grad.__get__) and is_plain_read(torch.Tensor.grad.__set__)  # own component's
    assert not is_plain_read(torch.Tensor.add_) and not is_plain_read(torch.Tensor.__iadd__)
    assert not is_plain_read(torch.Tensor.copy_) and not is_plain_read(torch.Tensor.set_)


@pytest.fixture
def counters(mirrored2):
    """A sync-on-read variable whose replicas hold different values (1 and 2)."""
    with mirrored2.scope():
        v = unison.Variable(torch.zeros(3), synchronization="on_read", aggregation="sum")

    def fill() -> None:
        replica = unison.get_replica_context().replica_id_in_sync_group
        with torch.no_grad():
            v.copy_(torch.full((3,), float(replica + 1)))

    mirrored2.run(fill)
    return mirrored2, v


@pytest.mark.parametrize("read", [
    lambda v: v * 1,  # a dunder with the variable first
    lambda v: 0 + v,  # ... and second
    lambda v: F.linear(v.unsqueeze(0), torch.eye(3)).squeeze(0),  # a variable positional among tensors
    lambda v: torch.stack([v, v]).sum(0) / 2,  # variables inside a list: the general path
    lambda v: torch.add(torch.zeros(3), other=v),  # a variable as keyword: the general path
], ids=["mul", "radd", "linear", "stack", "keyword"])
def test_each_replica_reads_its_own_component(counters, read):
    strategy, v = counters
    out = strategy.run(lambda: read(v))
    assert [t.tolist() for t in strategy.experimental_local_results(out)] == [[1.0] * 3, [2.0] * 3]


def test_in_place_writes_still_go_through_the_variable(mirrored2):
    with mirrored2.scope():
        w = unison.Variable(torch.zeros(2))  # mirrored, aggregation NONE: replicas may not write it
    with pytest.raises(ValueError, match="aggregation=VariableAggregation.NONE"):
        mirrored2.run(lambda: w.add_(1.0))
