"""ParameterServerStrategy on the coordinator: validation, placement, reads and writes.

The ps tasks run in this process (Server threads); no worker is needed to place and
read variables.
"""

import os
import secrets

import pytest
import torch
from torch import nn

import unison
from unison._ps.remote_variables.ps_variables import PSVariable


@pytest.fixture
def ps_servers():
    os.environ["UNISON_AUTHKEY"] = secrets.token_hex(32)
    placeholder = {"ps": ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]}
    servers = [unison.Server(placeholder, "ps", i, bind_address="127.0.0.1:0") for i in range(3)]
    yield [s.address for s in servers]
    for server in servers:
        server.stop()


def _resolver(ps, workers=("127.0.0.1:9",)):
    spec = unison.ClusterSpec({"chief": ["127.0.0.1:8"], "worker": list(workers), "ps": list(ps)})
    return unison.SimpleClusterResolver(spec, task_type="chief", task_id=0)


@pytest.mark.parametrize("cluster, message", [
    ({}, "Cluster spec must be non-empty"),
    ({"chief": ["a:1"], "worker": ["a:2"]}, "There must be at least one ps"),
    ({"chief": ["a:1"], "ps": ["a:2"]}, "There must be at least one worker"),
])
def test_bad_clusters_raise_before_connecting(cluster, message):
    resolver = unison.SimpleClusterResolver(unison.ClusterSpec(cluster))
    with pytest.raises(ValueError, match=message):
        unison.ParameterServerStrategy(resolver)


def test_strategy_runs_on_the_chief_only_and_coordinator_needs_it():
    spec = unison.ClusterSpec({"chief": ["a:1"], "worker": ["a:2"], "ps": ["a:3"]})
    with pytest.raises(ValueError, match="'worker'.*unison.Server"):
        unison.ParameterServerStrategy(unison.SimpleClusterResolver(spec, task_type="worker", task_id=0))
    with pytest.raises(ValueError, match="timeout_seconds"):
        unison.ParameterServerStrategy(unison.SimpleClusterResolver(spec), timeout_seconds=0)
    with pytest.raises(ValueError, match="needs a ParameterServerStrategy"):
        unison.ClusterCoordinator(unison.OneDeviceStrategy("cpu:0"))


@pytest.mark.timeout(30)
def test_round_robin_and_least_loaded_placement(ps_servers):
    strategy = unison.ParameterServerStrategy(_resolver(ps_servers))
    with strategy.scope():
        layers = [nn.Linear(10, 10), nn.Linear(10, 100)]
    devices = [strategy.extended.variable_placement(p) for m in layers for p in m.parameters()]
    assert devices == [f"/job:ps/replica:0/task:{i % 3}" for i in range(4)]
    strategy = unison.ParameterServerStrategy(_resolver(ps_servers), variable_placer="least_loaded")
    with strategy.scope():
        big, small = nn.Linear(100, 100), nn.Linear(2, 2)
    # 10000 -> ps0, 100 -> ps1, 4 -> ps2, 2 -> ps2 (4 < 100)
    assert [strategy.extended.variable_placement(p).rsplit(":", 1)[1]
            for p in (*big.parameters(), *small.parameters())] == ["0", "1", "2", "2"]
    with pytest.raises(ValueError, match="not created in a ParameterServerStrategy"):
        strategy.extended.variable_placement(torch.zeros(1))


@pytest.mark.timeout(30)
def test_bad_placer_result_is_named(ps_servers):
    strategy = unison.ParameterServerStrategy(_resolver(ps_servers), variable_placer=lambda n: 7)
    with pytest.raises(ValueError, match="placer returned 7.*0..2"):
        with strategy.scope():
            nn.Linear(2, 2)


@pytest.mark.timeout(30)
def test_reads_writes_print_and_checkpoint_go_to_the_ps(ps_servers, tmp_path):
    strategy = unison.ParameterServerStrategy(
        _resolver(ps_servers), variable_partitioner=unison.partitioners.FixedShardsPartitioner(2))
    torch.manual_seed(0)
    with strategy.scope():
        model = nn.Linear(3, 5)
        counter = unison.Variable(torch.zeros(1, 2), name="counter")  # one row: not sharded
    assert isinstance(counter, PSVariable)
    assert isinstance(model.weight, unison.ShardedVariable)
    assert [tuple(s.shape) for s in model.weight.variables] == [(3, 3), (2, 3)]
    reference = nn.Linear(3, 5)
    reference.load_state_dict(model.state_dict())  # whole tensors from the ps tasks
    x = torch.randn(4, 3)
    torch.testing.assert_close(model(x), reference(x))
    with torch.no_grad():
        model.bias.add_(1.0)  # in place on the coordinator: written to the ps task
        counter.assign(torch.tensor([[3.0, 4.0]]))
    torch.testing.assert_close(model.bias.read_value(), reference.bias.detach() + 1)
    assert counter.read_value().tolist() == [[3.0, 4.0]]
    assert "3., 4." in repr(counter) and "/job:ps/replica:0/task:" in repr(counter)
    # a checkpoint holds plain whole tensors and loads into a plain module
    unison.save_checkpoint({"model": model.state_dict()}, tmp_path / "ckpt.pt", strategy=strategy)
    plain = nn.Linear(3, 5)
    plain.load_state_dict(unison.load_checkpoint(tmp_path / "ckpt.pt")["model"])
    torch.testing.assert_close(plain.bias, model.bias.read_value())
    # and back: load_state_dict on the ps model writes the ps tasks
    model.load_state_dict(reference.state_dict())
    torch.testing.assert_close(model.weight.read_value(), reference.weight.detach())


@pytest.mark.timeout(30)
def test_place_parameters_in_uses_names_of_the_outermost_module(ps_servers):
    strategy = unison.ParameterServerStrategy(_resolver(ps_servers))
    policy = strategy.extended.components.variable_policy  # the placement hook lives on the variable policy
    with strategy.scope():
        with policy.place_parameters_in(lambda name: 2 if name.startswith("1.") else 1):
            model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
        with pytest.raises(ValueError, match="assign\\('weight'\\) returned 9"):
            with policy.place_parameters_in(lambda name: 9):
                nn.Linear(2, 2)
    placed = {n: strategy.extended.variable_placement(t)[-1]
              for n, t in [*model.named_parameters(), *model.named_buffers()]}
    assert placed == {"0.weight": "1", "0.bias": "1", "1.weight": "2", "1.bias": "2", "1.running_mean": "2",
                      "1.running_var": "2", "1.num_batches_tracked": "2"}  # buffers follow their module too


@pytest.mark.timeout(30)
def test_round_robin_placement_puts_each_subnetwork_on_its_dedicated_ps_group(ps_servers):
    """Issue 12 item 3 on a real ParameterServerStrategy: subnetwork i's parameters live on its ps group."""
    from unison.placement import OpNameHashStrategy, PlacementConfig, RoundRobinStrategy, subnetwork_ps_group

    strategy = unison.ParameterServerStrategy(_resolver(ps_servers))
    num_ps = len(strategy.ps_cluster.ps)
    placement = RoundRobinStrategy()
    placement.config = PlacementConfig(num_worker_replicas=4, global_id_in_cluster=0, num_ps_replicas=num_ps)
    subnetworks = []
    with strategy.scope():
        for index in range(2):
            with placement.subnetwork_devices(2, index):
                subnetworks.append(nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 2)))
    for index, subnetwork in enumerate(subnetworks):
        group = subnetwork_ps_group(num_ps, 2, index)
        for name, param in subnetwork.named_parameters():
            task = group.start + OpNameHashStrategy(len(group))(name)
            assert strategy.extended.variable_placement(param) == f"/job:ps/replica:0/task:{task}"


def test_server_needs_a_job_name_and_refuses_a_wrong_key():
    with pytest.raises(ValueError, match="job_name"):
        unison.Server({"ps": ["127.0.0.1:1"]}, authkey=secrets.token_bytes(32))
    server = unison.Server({"ps": ["127.0.0.1:1"]}, "ps", 0, authkey=secrets.token_bytes(32),
                           bind_address="127.0.0.1:0")
    try:
        from unison._ps.wire.client import PSClient
        from unison.errors import AuthenticationError

        client = PSClient([server.address], secrets.token_bytes(32), timeout=5)
        with pytest.raises(unison.errors.ParameterServerError) as info:
            client.ping(0)
        assert isinstance(info.value.__cause__, AuthenticationError)
        # The ps task serves on with its variables: the message says only how to fix the key.
        message = str(info.value)
        assert message.startswith(f"ps:0 at {server.address} refused this task's key"), message
        assert "same UNISON_AUTHKEY (or UNISON_AUTHKEY_FILE)" in message, message
        assert "lost" not in message and "restore" not in message and "checkpoint" not in message, message
        assert not server.join(0)  # still serving
    finally:
        server.stop()
