"""CPU replicas keep their gradients in one flat buffer per replica and dtype (replica_grad_buffers.py).

The merge reduces whole buffers; what users see must not change: ``zero_grad()`` still
leaves None, a parameter without a gradient still has None after the backward pass (an
optimizer skips it), a gradient kept from an earlier step is never overwritten, and
the results equal the general reduction's and plain PyTorch's (autograd on each
replica's half of the batch, averaged or summed; single-device training).
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from torch import nn

import unison
from unison._collectives.ops.local import ReductionToOneDevice
from unison._gradient_sync.replicas import replica_grad_buffers

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _buffers_for_small_models(monkeypatch):
    """These models have a handful of gradients: let the buffers take them anyway."""
    monkeypatch.setattr(replica_grad_buffers, "MIN_GRADIENTS", 1)


def _general() -> unison.MirroredStrategy:
    """Mirrored with a reduction that takes the general path (no buffers)."""
    strategy = unison.MirroredStrategy(["cpu:0", "cpu:1"], cross_device_ops=ReductionToOneDevice(
        accumulation_fn=lambda tensors: sum(tensors[1:], tensors[0].clone())))
    assert strategy.extended.components.gradient_sync.merge.buffers is None
    return strategy


def _halves(x: torch.Tensor) -> unison.PerReplica:
    return unison.PerReplica(list(x.chunk(2)))


def _scaled_loss(model: nn.Module, batch: torch.Tensor, replica: int) -> torch.Tensor:
    """Replica ``replica``'s loss, scaled by ``replica + 1`` so the replicas' gradients differ."""
    return model(batch).pow(2).sum() * (replica + 1)


def _plain_reduced(model: nn.Module, x: torch.Tensor, reduce_op: str = "mean") -> list[torch.Tensor | None]:
    """The oracle, in plain PyTorch: each replica's gradients of ``model``'s parameters from a
    copy of it on its half of ``x`` (``_scaled_loss``), summed or averaged; None for a
    parameter no replica computed a gradient for."""
    per_replica = []
    for replica, half in enumerate(x.chunk(2)):
        here = copy.deepcopy(model)
        _scaled_loss(here, half, replica).backward()
        per_replica.append([p.grad for p in here.parameters()])
    total = [None if grads[0] is None else grads[0] + grads[1] for grads in zip(*per_replica)]
    return [t if t is None or reduce_op == "sum" else t / 2 for t in total]


class _TwoHeads(nn.Module):
    """A shared layer and two heads; ``head`` picks the one the loss uses (the other gets no gradient)."""

    def __init__(self, dtype: torch.dtype = torch.float32, head_dtype: torch.dtype = torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.shared = nn.Linear(4, 3, dtype=dtype)
        self.used = nn.Linear(3, 2, dtype=head_dtype)
        self.unused = nn.Linear(3, 2, dtype=head_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.shared(x)
        return self.used(hidden.to(self.used.weight.dtype))


def _grads_after_one_backward(strategy: unison.MirroredStrategy, seed: int) -> dict:
    """Per replica: clones of the used layers' gradients after one backward pass (replica
    ``r``'s loss scaled by ``r + 1``, so the replicas differ), and their storages."""
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(seed))
    with strategy.scope():
        model = _TwoHeads()
    out = {}

    def step(batch):
        replica = unison.get_replica_context().replica_id_in_sync_group
        _scaled_loss(model, batch, replica).backward()
        used = [model.shared.weight.grad, model.shared.bias.grad, model.used.weight.grad, model.used.bias.grad]
        out[replica] = ([g.clone() for g in used], {g.untyped_storage().data_ptr() for g in used})

    strategy.run(step, args=(_halves(x),))
    return out


def _plain_used_grads(seed: int, reduce_op: str = "mean") -> list[torch.Tensor]:
    """``_grads_after_one_backward``'s gradients, by the plain PyTorch oracle."""
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(seed))
    shared_w, shared_b, used_w, used_b, unused_w, unused_b = _plain_reduced(_TwoHeads(), x, reduce_op)
    assert unused_w is None and unused_b is None
    return [shared_w, shared_b, used_w, used_b]


def test_gradients_are_aliases_of_one_buffer_per_replica_and_equal_the_general_reduction(mirrored2):
    fast, general = _grads_after_one_backward(mirrored2, 1), _grads_after_one_backward(_general(), 1)
    plain = _plain_used_grads(1)
    for replica in (0, 1):
        for a, b, p in zip(fast[replica][0], general[replica][0], plain):
            torch.testing.assert_close(a, p)  # the mean of plain autograd's gradients on the halves
            assert torch.equal(a, b)
    assert len(fast[0][1]) == 1 and len(fast[1][1]) == 1 and fast[0][1] != fast[1][1]  # one buffer each
    assert len(general[0][1]) == 4  # the general path: a tensor per gradient


def test_zero_grad_leaves_none_and_a_parameter_without_gradient_is_skipped(mirrored2):
    """Weight decay moves a parameter stepped with a zero gradient: the unused head must stay put."""
    reference = _TwoHeads()
    reference_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    with mirrored2.scope():
        model = _TwoHeads()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    unused_before = copy.deepcopy(reference.unused.state_dict())
    seen = []

    def step(batch):
        opt.zero_grad()
        seen.append(all(p.grad is None for p in model.parameters()))
        model(batch).pow(2).mean().backward()
        seen.append(model.unused.weight.grad is None and model.unused.bias.grad is None)
        opt.step()

    g = torch.Generator().manual_seed(2)
    for _ in range(4):
        x = torch.randn(8, 4, generator=g)
        mirrored2.run(step, args=(_halves(x),))
        reference_opt.zero_grad()
        reference(x).pow(2).mean().backward()
        reference_opt.step()
    assert all(seen) and len(seen) == 16
    for name, value in unused_before.items():
        assert torch.equal(getattr(model.unused, name).detach(), value)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p.detach(), q.detach(), atol=1e-6)


def test_a_gradient_kept_from_an_earlier_step_is_never_overwritten(mirrored2):
    with mirrored2.scope():
        model = _TwoHeads()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kept, graphs = [], []

    def step(batch, keep):
        opt.zero_grad()
        model(batch).pow(2).mean().backward()
        opt.step()
        if keep == "tensor":
            kept.append((model.shared.weight.grad, model.shared.weight.grad.clone()))
        elif keep == "view":
            kept.append((model.used.weight.grad.view(-1), model.used.weight.grad.clone().view(-1)))
        elif keep == "graph":  # saved by autograd for a backward pass still to come: held outside Python
            grad = model.shared.bias.grad
            weight = torch.ones_like(grad, requires_grad=True)
            graphs.append((grad * weight).sum())  # and no Python reference to the gradient
        elif keep == "storage":  # a tensor of its own over the gradient's memory: no view of it
            grad = model.used.bias.grad
            alias = torch.empty(0, dtype=grad.dtype).set_(grad.untyped_storage(), grad.storage_offset(), grad.shape)
            kept.append((alias, grad.clone()))

    g = torch.Generator().manual_seed(3)
    for keep in ("tensor", "view", "graph", "storage", None, None):
        mirrored2.run(step, args=(_halves(torch.randn(8, 4, generator=g)), keep))
    assert len(kept) == 6 and len(graphs) == 2  # each replica keeps its own
    for tensor, value in kept:
        assert torch.equal(tensor, value)
    for graph in graphs:
        graph.backward()  # autograd checks that the gradient it saved was not written since


def test_two_dtypes_get_a_buffer_each_and_train_as_the_general_path(mirrored2):
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    weights = []
    for strategy in (mirrored2, _general()):
        with strategy.scope():
            model = _TwoHeads(dtype=torch.float64, head_dtype=torch.float32)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)

        # step runs within the iteration (strategy.run below), so the loop's model and opt are the ones wanted
        def step(batch):
            opt.zero_grad()  # noqa: B023
            model(batch).pow(2).mean().backward()  # noqa: B023
            opt.step()  # noqa: B023

        for _ in range(3):
            strategy.run(step, args=(_halves(x),))
        weights.append([p.detach().clone() for p in model.parameters()])
    buffers = mirrored2.extended.components.gradient_sync.merge.buffers
    assert set(buffers._replicas[0].flats) == {torch.float64, torch.float32}
    reference = _TwoHeads(dtype=torch.float64, head_dtype=torch.float32)  # plain SGD, one device, whole batch
    reference_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(3):
        reference_opt.zero_grad()
        reference(x).pow(2).mean().backward()
        reference_opt.step()
    for a, b, p in zip(*weights, reference.parameters()):
        torch.testing.assert_close(a, p.detach(), rtol=1e-5, atol=1e-6)
        assert torch.equal(a, b)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_create_graph_and_later_variables_take_the_general_path_then_the_buffers(mirrored2):
    """Gradients that require grad cannot live in a buffer; variables made after the first
    step join a new layout. Slots autograd never wrote are None again either way."""
    with mirrored2.scope():
        model = _TwoHeads()
    out = {}

    def step(batch, create_graph):
        replica = unison.get_replica_context().replica_id_in_sync_group
        for p in model.parameters():
            p.grad = None
        model(batch).pow(2).sum().backward(create_graph=create_graph)
        out[replica] = ([p.grad is None for p in model.unused.parameters()],
                        model.used.weight.grad.detach().clone(), model.used.weight.grad.requires_grad)

    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(5))
    mirrored2.run(step, args=(_halves(x), True))
    general_value = out[0][1]
    assert out[0][0] == [True, True] and out[0][2] and torch.equal(out[0][1], out[1][1])
    replaced = weakref.ref(model.unused.weight)
    with mirrored2.scope():
        model.unused = nn.Linear(3, 2)  # a variable made after the layout
    mirrored2.run(step, args=(_halves(x), False))
    assert out[0][0] == [True, True] and not out[0][2] and torch.equal(out[0][1], general_value)
    layout = mirrored2.extended.components.gradient_sync.merge.buffers._replicas[0]
    assert len(layout.aliases) == 6 and any(c is model.unused.weight.component(0) for c in layout.components)
    gc.collect()
    assert replaced() is None  # the layout does not keep a replaced layer's variables alive


def test_large_gradients_and_small_models_keep_the_general_path(mirrored2, monkeypatch):
    """A gradient above SMALL_GRADIENT elements is taken over by autograd and reduced on its
    own; with fewer than MIN_GRADIENTS small ones there are no buffers at all."""
    monkeypatch.setattr(replica_grad_buffers, "SMALL_GRADIENT", 12)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(6))

    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 2))  # weights of 20 and 10 elements

    results = []
    for strategy in (mirrored2, _general()):
        with strategy.scope():
            model = make()
        out = {}

        # step runs within the iteration (strategy.run below), so the loop's model and out are the ones wanted
        def step(batch):
            replica = unison.get_replica_context().replica_id_in_sync_group
            _scaled_loss(model, batch, replica).backward()  # noqa: B023
            out[replica] = [(p.grad.clone(), p.grad.untyped_storage().data_ptr())  # noqa: B023
                            for p in model.parameters()]  # noqa: B023

        strategy.run(step, args=(_halves(x),))
        results.append(out)
    buffers = mirrored2.extended.components.gradient_sync.merge.buffers._replicas
    for replica in (0, 1):
        flat = buffers[replica].flats[torch.float32].untyped_storage().data_ptr()
        in_buffer = [ptr == flat for _, ptr in results[0][replica]]
        assert in_buffer == [False, True, True, True]  # the 20-element weight is above the bound
        for (got, _), (want, _), plain in zip(results[0][replica], results[1][replica], _plain_reduced(make(), x)):
            torch.testing.assert_close(got, plain)
            assert torch.equal(got, want)

    monkeypatch.setattr(replica_grad_buffers, "MIN_GRADIENTS", 32)
    few = unison.MirroredStrategy(["cpu:0", "cpu:1"])
    with few.scope():
        small = _TwoHeads()
    few.run(lambda batch: small(batch).pow(2).sum().backward(), args=(_halves(x),))
    assert few.extended.components.gradient_sync.merge.buffers._replicas == []


def test_a_resized_parameter_gets_a_new_layout(mirrored2):
    with mirrored2.scope():
        model = _TwoHeads()
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(7))
    out = {}

    def step(batch):
        replica = unison.get_replica_context().replica_id_in_sync_group
        for p in model.parameters():
            p.grad = None
        model(batch).pow(2).sum().backward()
        out[replica] = (model.used.weight.grad.clone(), model.unused.weight.grad)

    mirrored2.run(step, args=(_halves(x),))
    before = out[0][0]
    with torch._C.DisableTorchFunctionSubclass():
        for i in range(2):  # param.data = ... on every replica's component of the unused head
            torch.Tensor.data.__set__(model.unused.weight.component(i), torch.zeros(3, 3))
    buffers = mirrored2.extended.components.gradient_sync.merge.buffers
    for _ in range(2):  # the first step meets the resized slot and takes the general path; the next, a new layout
        mirrored2.run(step, args=(_halves(x),))
        assert torch.equal(out[0][0], before) and torch.equal(out[1][0], before)
        assert out[0][1] is None and out[1][1] is None
    assert [a.shape for a in buffers._replicas[0].aliases][4] == (3, 3)


def test_a_buffer_nobody_else_holds_is_reused_step_after_step(mirrored2):
    with mirrored2.scope():
        model = _TwoHeads()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(batch):
        opt.zero_grad()
        model(batch).pow(2).mean().backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # in place, on the reduced gradients
        opt.step()

    buffers = mirrored2.extended.components.gradient_sync.merge.buffers
    g = torch.Generator().manual_seed(9)
    flats = []
    for _ in range(4):
        mirrored2.run(step, args=(_halves(torch.randn(8, 4, generator=g)),))
        flats.append([r.flats[torch.float32] for r in buffers._replicas])
    assert all(a is b for later in flats[1:] for a, b in zip(flats[0], later))


def _count_flat_reductions(monkeypatch) -> list:
    """Records each reduction of whole buffers (its ``mean`` argument)."""
    calls: list = []
    original = replica_grad_buffers.ReplicaGradBuffers._reduce_flats

    def counting(self, mean, *rest):
        calls.append(mean)
        return original(self, mean, *rest)

    monkeypatch.setattr(replica_grad_buffers.ReplicaGradBuffers, "_reduce_flats", counting)
    return calls


def test_a_sum_reduction_adds_the_buffers(mirrored2, monkeypatch):
    calls = _count_flat_reductions(monkeypatch)
    general = _general()
    for strategy in (mirrored2, general):
        strategy.extended.gradient_reduce_op = unison.ReduceOp.SUM
    got, want = _grads_after_one_backward(mirrored2, 10), _grads_after_one_backward(general, 10)
    assert calls == [False]  # whole buffers, summed
    plain = _plain_used_grads(10, "sum")
    for replica in (0, 1):
        for a, b, p in zip(got[replica][0], want[replica][0], plain):
            torch.testing.assert_close(a, p)  # the sum of plain autograd's gradients on the halves
            assert torch.equal(a, b)
