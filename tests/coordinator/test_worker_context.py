"""Worker context properties and the coordinator's single-process paths (no network)."""

import json

import pytest
from _coordinator_fakes import FakeStrategy

from unison import ClusterSpec
from unison.coordinator import (
    CoordinatorMode,
    WorkerContext,
    get_current_worker_context,
    run_distribute_coordinator,
    run_standard_server,
)

CHIEF_CLUSTER = {"chief": ["c:1"], "worker": ["w0:1", "w1:1"], "evaluator": ["e:1"]}
WORKER_CLUSTER = {"worker": ["w0:1", "w1:1"], "ps": ["p:1"]}


@pytest.mark.parametrize(
    "cluster, task_type, task_id, chief, target, workers, distributed",
    [
        (None, None, None, True, "", 0, False),
        (CHIEF_CLUSTER, "chief", 0, True, "tcp://c:1", 3, True),
        (CHIEF_CLUSTER, "worker", 0, False, "tcp://w0:1", 3, True),
        (CHIEF_CLUSTER, "evaluator", 0, True, "tcp://e:1", 3, False),
        (CHIEF_CLUSTER, None, None, True, "tcp://c:1", 3, True),  # in-graph: the chief's target
        (WORKER_CLUSTER, "worker", 0, True, "tcp://w0:1", 2, True),
        (WORKER_CLUSTER, "worker", 1, False, "tcp://w1:1", 2, True),
        (WORKER_CLUSTER, None, None, True, "tcp://w0:1", 2, True),
    ],
)
def test_worker_context_properties(cluster, task_type, task_id, chief, target, workers, distributed):
    context = WorkerContext(FakeStrategy(), cluster, task_type, task_id)
    assert (context.task_type, context.task_id) == (task_type, task_id)
    assert context.is_chief is chief
    assert context.master_target == target
    assert context.num_workers == workers
    assert context.distributed_mode is distributed
    assert context.cluster_spec == ClusterSpec(cluster)
    assert not context.has_barrier


def test_rpc_layer_and_strategy_flags():
    strategy = FakeStrategy()
    strategy.extended.should_checkpoint = False
    context = WorkerContext(strategy, WORKER_CLUSTER, "worker", 1, rpc_layer=None)
    assert context.master_target == "w1:1"
    assert (context.should_checkpoint, context.should_save_summary,
            context.experimental_should_init) == (False, True, True)
    alone = WorkerContext(None, CHIEF_CLUSTER, "evaluator", 0)
    assert (alone.should_checkpoint, alone.should_save_summary, alone.experimental_should_init) == (True, True, True)


def test_context_is_current_only_inside_and_cannot_nest():
    assert get_current_worker_context() is None
    with WorkerContext(None, WORKER_CLUSTER, "worker", 1) as context:
        assert get_current_worker_context() is context
        with pytest.raises(ValueError, match="cannot run inside a `worker_fn`"):
            with WorkerContext(None, None, None, None):
                pass
    assert get_current_worker_context() is None


def test_wait_for_other_workers_uses_the_barrier():
    class CountingBarrier:
        calls = 0

        def wait(self):
            self.calls += 1

    barrier = CountingBarrier()
    context = WorkerContext(None, WORKER_CLUSTER, "worker", 0, barrier=barrier)
    assert context.has_barrier
    context.wait_for_other_workers()
    context.wait_for_other_workers()
    assert barrier.calls == 2
    WorkerContext(None, None, None, None).wait_for_other_workers()  # nobody to wait for: returns


def _describe(strategy):
    context = get_current_worker_context()
    return {
        "task": (context.task_type, context.task_id),
        "configured": strategy.configured if strategy is not None else None,
        "chief": context.is_chief,
        "distributed": context.distributed_mode,
    }


@pytest.mark.parametrize("mode", list(CoordinatorMode) + ["independent_worker"])
def test_local_mode_runs_worker_fn_then_eval_fn(mode):
    evaluated = []
    strategy = FakeStrategy()
    result = run_distribute_coordinator(
        _describe, strategy, eval_fn=lambda s: evaluated.append(_describe(s)), eval_strategy=FakeStrategy(), mode=mode,
        environ={}
    )
    assert result == {"task": (None, None), "configured": (None, None, None), "chief": True, "distributed": False}
    assert evaluated == [{"task": (None, None), "configured": (None, None, None), "chief": True, "distributed": False}]
    assert strategy.configured == "never"  # each task configures its own copy


def test_single_worker_independent_cluster_needs_no_coordination():
    environ = {"TF_CONFIG": json.dumps({"cluster": {"worker": ["127.0.0.1:1"]},
                                        "task": {"type": "worker", "index": 0}})}
    result = run_distribute_coordinator(_describe, FakeStrategy(), mode="independent_worker", environ=environ)
    assert result == {
        "task": ("worker", 0),
        "configured": ({"worker": ["127.0.0.1:1"]}, "worker", 0),
        "chief": True,
        "distributed": True,
    }


def test_explicit_arguments_win_over_tf_config():
    environ = {"TF_CONFIG": json.dumps({"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
                                        "task": {"type": "worker", "index": 1}})}
    result = run_distribute_coordinator(
        _describe, FakeStrategy(), mode="independent_worker", cluster_spec={"chief": ["127.0.0.1:3"]},
        task_type="chief", task_id=0, environ=environ
    )
    assert result["task"] == ("chief", 0)
    assert result["configured"] == ({"chief": ["127.0.0.1:3"]}, "chief", 0)


def test_in_graph_standalone_client_runs_worker_fn_once_in_the_client():
    result = run_distribute_coordinator(
        _describe, FakeStrategy(between_graph=False), cluster_spec=WORKER_CLUSTER, authkey=b"k" * 16, environ={}
    )
    assert result == {"task": (None, None), "configured": (WORKER_CLUSTER, None, None), "chief": True,
                      "distributed": True}


def test_coordinator_argument_errors():
    with pytest.raises(ValueError, match=r"unknown coordinator mode 'in_graph'; "
                                         r"use one of \['standalone_client', 'independent_worker'\]"):
        run_distribute_coordinator(_describe, FakeStrategy(), mode="in_graph", environ={})
    with pytest.raises(ValueError, match="INDEPENDENT_WORKER mode needs this task's type"):
        run_distribute_coordinator(_describe, FakeStrategy(), mode="independent_worker", cluster_spec=WORKER_CLUSTER,
                                   environ={})
    with pytest.raises(ValueError, match="needs the cluster's key: set UNISON_AUTHKEY"):
        run_distribute_coordinator(_describe, FakeStrategy(), cluster_spec=WORKER_CLUSTER, environ={})
    with pytest.raises(ValueError, match="has no 'chief' or 'worker' job"):
        run_distribute_coordinator(_describe, FakeStrategy(), cluster_spec={"ps": ["p:1"]}, authkey=b"k" * 16,
                                   environ={})
    with pytest.raises(ValueError, match="TF_CONFIG task index 5 is out of range"):
        environ = {"TF_CONFIG": json.dumps({"cluster": WORKER_CLUSTER, "task": {"type": "worker", "index": 5}})}
        run_distribute_coordinator(_describe, FakeStrategy(), mode="independent_worker", environ=environ)


def test_run_standard_server_errors():
    key = {"UNISON_AUTHKEY": "ab" * 16}
    with pytest.raises(ValueError, match="TF_CONFIG is not set"):
        run_standard_server(environ=key)
    with pytest.raises(ValueError, match="TF_CONFIG has no `task`"):
        run_standard_server(environ={**key, "TF_CONFIG": json.dumps({"cluster": WORKER_CLUSTER})})
    with pytest.raises(ValueError, match="has no 'chief' or 'worker' job"):
        run_standard_server(environ={**key, "TF_CONFIG": json.dumps({"cluster": {"ps": ["127.0.0.1:1"]},
                                                                     "task": {"type": "ps", "index": 0}})})
    with pytest.raises(ValueError, match="needs the cluster's key"):
        run_standard_server(environ={"TF_CONFIG": json.dumps({"cluster": WORKER_CLUSTER,
                                                              "task": {"type": "worker", "index": 0}})})
