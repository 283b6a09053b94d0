"""The reference example (merge_call + reduce_to + update) under the three strategies.

Sections 1.2 / 4.1 of the reference: each replica contributes 1.0, the merge function
sums the contributions onto the variable and assigns them, so a variable shared by
two replicas ends at 2.0 and one on one device at 1.0.
"""

from __future__ import annotations

import pytest
import torch

import unison
from unison import ReduceOp

pytestmark = pytest.mark.timeout(30)  # replicas are threads: a hung rendezvous fails the test


def step_fn(var: torch.Tensor) -> None:
    def merge_fn(strategy: unison.Strategy, value: unison.PerReplica, var: torch.Tensor) -> None:
        # value is a DistributedValues here: one 1.0 per replica.
        reduced = strategy.extended.reduce_to(ReduceOp.SUM, value, destinations=var)
        strategy.extended.update(var, lambda var, value: var.copy_(value), args=(reduced,))

    value = torch.tensor(1.0)
    unison.get_replica_context().merge_call(merge_fn, args=(value, var))


def step_fn_batch(var: torch.Tensor) -> None:
    """Section 1.2's variant: ``batch_reduce_to`` instead of ``reduce_to``."""

    def merge_fn(strategy: unison.Strategy, value: unison.PerReplica, var: torch.Tensor) -> None:
        reduced = strategy.extended.batch_reduce_to(ReduceOp.SUM, [(value, var)])[0]
        strategy.extended.update(var, lambda var, value: var.copy_(value), args=(reduced,))

    unison.get_replica_context().merge_call(merge_fn, args=(torch.tensor(1.0), var))


def run(strategy: unison.Strategy, fn=step_fn) -> torch.Tensor:
    with strategy.scope():
        v = unison.Variable(0.0)
    strategy.run(fn, args=(v,))
    return v


@pytest.mark.parametrize("fn", [step_fn, step_fn_batch], ids=["reduce_to", "batch_reduce_to"])
def test_mirrored_gives_mirrored_variable_of_two(fn, thread_baseline):
    v = run(unison.MirroredStrategy(["cpu:0", "cpu:1"]), fn)
    assert isinstance(v, unison.MirroredVariable)
    assert len(v.values) == 2
    assert [c.item() for c in v.values] == [2.0, 2.0]
    assert v.devices == ("cpu:0", "cpu:1")
    assert "MirroredVariable" in repr(v)


@pytest.mark.parametrize("fn", [step_fn, step_fn_batch], ids=["reduce_to", "batch_reduce_to"])
def test_central_storage_gives_one_variable_of_two(fn, thread_baseline):
    v = run(unison.CentralStorageStrategy(compute_devices=["cpu:0", "cpu:1"], parameter_device="CPU:0"), fn)
    assert len(v.values) == 1  # one storage, on the parameter device
    assert v.item() == 2.0
    assert not isinstance(v, unison.SyncOnReadVariable)


@pytest.mark.parametrize("fn", [step_fn, step_fn_batch], ids=["reduce_to", "batch_reduce_to"])
def test_one_device_gives_one(fn):
    v = run(unison.OneDeviceStrategy("cpu:0"), fn)
    assert not isinstance(v, unison.DistributedValues)  # a plain tensor on the device
    assert type(v) is torch.Tensor
    assert v.item() == 1.0


def test_mirrored_tf_device_names(thread_baseline):
    # The reference spells devices "GPU:0"; on a CPU-only machine the same example runs on
    # logical CPU devices spelled the TensorFlow way.
    v = run(unison.MirroredStrategy(["/device:CPU:0", "CPU:1"]))
    assert [c.item() for c in v.values] == [2.0, 2.0]
