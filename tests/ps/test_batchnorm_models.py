"""Models with BatchNorm (every ResNet) on a ps worker whose cache lives in shared memory.

The worker's cached parameters and buffers are all tensors of one shared-memory segment.
They were views of it, and views of one base share one autograd version counter: the
running-statistics update BatchNorm makes in place during forward then bumped the
version of the convolution weight saved for backward, and backward refused it
("modified by an inplace operation"). With tensors of their own, a conv + BatchNorm
model trains on a worker exactly as on one device, its statistics included.
"""

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import unison
from tests.ps._cluster import ps_cluster
from unison._ps.remote_variables.ps_variables import _RemoteParameter
from unison._ps.wire.shared_arena import SharedArena
from unison._ps.worker.runtime import RUNTIME


def _make():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 3))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


@contextlib.contextmanager
def _one_worker_cluster():
    """A chief's strategy and coordinator over 1 worker and 1 ps on this host; every task ends cleanly."""
    with ps_cluster(1, 1) as cluster:
        strategy = unison.ParameterServerStrategy(cluster.resolver(1, 1))
        coordinator = unison.ClusterCoordinator(strategy)
        yield strategy, coordinator
        coordinator.shutdown()
        assert cluster.stop() == {name: 0 for name in cluster.procs}


def _assert_state_equal(model, reference):
    state, expected = model.state_dict(), reference.state_dict()
    assert state.keys() == expected.keys()
    for name, value in expected.items():  # parameters and buffers (running statistics, batch count)
        torch.testing.assert_close(state[name], value, rtol=0, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def _train(model, optimizer, x, y):
    optimizer.zero_grad()
    F.mse_loss(model(x), y).backward()
    optimizer.step()


def _shared_ps_tasks():
    """The ps tasks that have mapped this worker's shared-memory arena."""
    return sorted(i for i, segments in RUNTIME.current.client._attached.items() if segments)


def test_arena_tensors_have_their_own_version_counters():
    # Writing one tensor of a segment in place must not look, to autograd, like a write to another.
    arena = SharedArena()
    try:
        a, b = arena.tensor((3,), torch.float32), arena.tensor((2, 2), torch.float64)
        before = (a._version, b._version)
        a.add_(1)
        assert (a._version, b._version) == (before[0] + 1, before[1])
        assert a._base is None and b._base is None  # not views: nothing shares their counters
        assert arena.place(b) is not None and b.is_contiguous() and b.shape == (2, 2)
        del a, b
    finally:
        arena.close()


@pytest.mark.timeout(60)
def test_conv_batchnorm_model_trains_on_a_worker_as_on_one_device():
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 2, 6, 6, generator=g) * 2 + 1, torch.randn(8, 3, generator=g)) for _ in range(4)]
    reference, ref_optimizer = _make()
    with _one_worker_cluster() as (strategy, coordinator):
        with strategy.scope():
            model, optimizer = _make()

        def step(x, y):
            _train(model, optimizer, x, y)
            return _shared_ps_tasks()

        for x, y in batches:  # one function at a time: the same steps as one device
            shared = coordinator.fetch(coordinator.schedule(step, args=(x, y)))
            _train(reference, ref_optimizer, x, y)
        assert shared == [0]  # the worker's cache was in shared memory, as on any one-host cluster
        assert reference.state_dict()["1.num_batches_tracked"].item() == len(batches)
        _assert_state_equal(model, reference)


def _language_model():
    """A 2-layer TransformerEncoder LM: nn.TransformerEncoder deep-copies its layer."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    model = nn.ModuleDict({"embed": nn.Embedding(40, 16),
                           "encoder": nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
                           "head": nn.Linear(16, 40)})
    return model, torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)


def _lm_step(model, optimizer, tokens):
    optimizer.zero_grad()
    logits = model["head"](model["encoder"](model["embed"](tokens[:, :-1])))
    F.cross_entropy(logits.reshape(-1, 40), tokens[:, 1:].reshape(-1)).backward()
    optimizer.step()


@pytest.mark.timeout(60)
def test_layers_cloned_in_the_scope_are_ps_variables_and_train_as_on_one_device():
    # A layer deep-copied in the scope used to be a plain local parameter: the coordinator
    # sent its values with the function, and the workers' updates to it were lost.
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 40, (8, 7), generator=g) for _ in range(3)]
    reference, ref_optimizer = _language_model()
    with _one_worker_cluster() as (strategy, coordinator):
        with strategy.scope():
            model, optimizer = _language_model()
        assert all(isinstance(p, _RemoteParameter) for p in model.parameters())
        snapshot = copy.deepcopy(model)  # outside the scope: a local snapshot, on purpose
        assert not any(isinstance(p, _RemoteParameter) for p in snapshot.parameters())
        for tokens in batches:
            coordinator.fetch(coordinator.schedule(_lm_step, args=(model, optimizer, tokens)))
            _lm_step(reference, ref_optimizer, tokens)
        _assert_state_equal(model, reference)


@pytest.mark.timeout(90)
def test_a_compiled_model_trains_on_a_worker_as_on_one_device():
    # torch.compile of a model built in the scope: the worker traces its cached parameters
    # (plain tensors), and its pushes carry the compiled backward's gradients.
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 2, 6, 6, generator=g), torch.randn(8, 3, generator=g)) for _ in range(3)]
    reference, ref_optimizer = _make()
    with _one_worker_cluster() as (strategy, coordinator):
        with strategy.scope():
            model, optimizer = _make()
        compiled = torch.compile(model, backend="aot_eager")

        def step(x, y):
            _train(compiled, optimizer, x, y)
            return sum(torch._dynamo.utils.counters["graph_break"].values())

        for x, y in batches:
            breaks = coordinator.fetch(coordinator.schedule(step, args=(x, y)))
            _train(reference, ref_optimizer, x, y)
        assert breaks == 0
        _assert_state_equal(model, reference)
