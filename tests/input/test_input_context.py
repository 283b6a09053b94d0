"""InputContext arithmetic, InputOptions and the enums."""

import pytest

from unison import AutoShardPolicy, InputContext, InputOptions, InputReplicationMode


def test_defaults_are_one_pipeline_one_replica():
    ctx = InputContext()
    assert (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync) == (1, 0, 1)
    assert ctx.get_per_replica_batch_size(7) == 7


@pytest.mark.parametrize(("global_batch", "replicas", "expected"), [(64, 4, 16), (6, 3, 2), (0, 2, 0), (8, 8, 1)])
def test_per_replica_batch_size(global_batch, replicas, expected):
    ctx = InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=replicas)
    assert ctx.get_per_replica_batch_size(global_batch) == expected


def test_indivisible_global_batch_names_both_numbers():
    ctx = InputContext(num_input_pipelines=2, input_pipeline_id=0, num_replicas_in_sync=4)
    with pytest.raises(ValueError,
                       match=r"`global_batch_size` 10 is not divisible by `num_replicas_in_sync` 4.*e\.g\. 8"):
        ctx.get_per_replica_batch_size(10)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"num_input_pipelines": 0}, ValueError, r"`num_input_pipelines` must be at least 1, got 0"),
        ({"num_input_pipelines": 2, "input_pipeline_id": 2}, ValueError,
         r"`input_pipeline_id` 2 is out of range.*0\.\.1"),
        ({"input_pipeline_id": -1}, ValueError, r"`input_pipeline_id` must be at least 0"),
        ({"num_replicas_in_sync": 0}, ValueError, r"`num_replicas_in_sync` must be at least 1"),
        ({"num_replicas_in_sync": 2.0}, TypeError, r"`num_replicas_in_sync` must be an int, got float"),
        ({"num_input_pipelines": True}, TypeError, r"`num_input_pipelines` must be an int, got bool"),
    ],
)
def test_bad_context_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        InputContext(**kwargs)


def test_per_replica_batch_size_rejects_non_int():
    with pytest.raises(TypeError, match=r"`global_batch_size` must be an int, got float"):
        InputContext().get_per_replica_batch_size(8.0)


def test_context_equality_and_repr():
    a = InputContext(2, 1, 4)
    assert a == InputContext(2, 1, 4) and hash(a) == hash(InputContext(2, 1, 4))
    assert a != InputContext(2, 0, 4)
    assert repr(a) == "InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=4)"


def test_options_defaults():
    options = InputOptions()
    assert options.experimental_fetch_to_device is True
    assert options.experimental_replication_mode is InputReplicationMode.PER_WORKER
    assert options.pin_memory is False
    assert options.auto_shard_policy is AutoShardPolicy.AUTO


def test_options_accept_member_names_in_any_case():
    options = InputOptions(experimental_replication_mode="per_replica", auto_shard_policy="DATA")
    assert options.experimental_replication_mode is InputReplicationMode.PER_REPLICA
    assert options.auto_shard_policy is AutoShardPolicy.DATA


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"auto_shard_policy": "hint"}, ValueError,
         r"`auto_shard_policy` must be an AutoShardPolicy member or one of its names \(AUTO, DATA, FILE, OFF.*'hint'"),
        ({"experimental_replication_mode": 1}, ValueError,
         r"`experimental_replication_mode` must be an InputReplicationMode member"),
        ({"pin_memory": "yes"}, TypeError, r"`pin_memory` must be a bool, got str"),
        ({"experimental_fetch_to_device": 1}, TypeError, r"`experimental_fetch_to_device` must be a bool"),
    ],
)
def test_bad_options(kwargs, error, match):
    with pytest.raises(error, match=match):
        InputOptions(**kwargs)
