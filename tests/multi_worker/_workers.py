"""Worker functions for the multi-worker tests (module level, so spawned processes import them)."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import time
import weakref
from typing import Any

import torch
from torch import nn

import unison
from unison._testing import connect_rendezvous_store

ADDRESSES = ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]  # never bound: run_workers provides the store


def strategy_for(rank: int, world: int, devices=None, **options):
    spec = unison.ClusterSpec({"worker": ADDRESSES[:world]})
    resolver = unison.SimpleClusterResolver(spec, task_type="worker", task_id=rank)
    comm = unison.CommunicationOptions(**options) if options else None
    return unison.MultiWorkerMirroredStrategy(resolver, comm, devices=devices)


def make_mlp(extra_layers: int = 0, width: int = 16) -> nn.Module:
    """An MLP; ``extra_layers`` hidden Linear(width, width) layers give buckets of many gradients."""
    torch.manual_seed(0)
    hidden = [module for _ in range(extra_layers) for module in (nn.Linear(width, width), nn.ReLU())]
    return nn.Sequential(nn.Linear(8, width), nn.ReLU(), *hidden, nn.Linear(width, 4))


def mlp_and_step(strategy: unison.Strategy, extra_layers: int = 0, width: int = 16, set_to_none: bool = True):
    """The MLP built in ``strategy``'s scope with SGD (momentum), and a training step on one batch."""
    with strategy.scope():
        model = make_mlp(extra_layers, width)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(x, y):
        opt.zero_grad(set_to_none=set_to_none)  # False: gradients stay views of the buckets
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return model, step


def global_batches(steps: int = 20, batch: int = 64):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 8, generator=g), torch.randint(0, 4, (batch,), generator=g)) for _ in range(steps)]


def single_device_weights(extra_layers: int = 0, width: int = 16) -> list[torch.Tensor]:
    model = make_mlp(extra_layers, width)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in global_batches():
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def train_mlp(rank: int, world: int, local_devices: int, extra_layers: int = 0, set_to_none: bool = True,
              width: int = 16, bytes_per_pack: int = 0, implementation: str = "AUTO"):
    options = {"bytes_per_pack": bytes_per_pack, "implementation": implementation}
    strategy = strategy_for(rank, world, devices=[f"cpu:{i}" for i in range(local_devices)], **options)
    model, step = mlp_and_step(strategy, extra_layers, width, set_to_none)

    for x, y in global_batches():
        xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
        if local_devices > 1:
            xs, ys = unison.PerReplica(list(xs.chunk(local_devices))), unison.PerReplica(list(ys.chunk(local_devices)))
        loss = strategy.run(step, args=(xs, ys))
    mean_loss = strategy.reduce("mean", loss)
    replicas_equal = all(
        torch.equal(c, p.values[0])
        for p in model.parameters() if isinstance(p, unison.MirroredVariable) for c in p.values
    )
    return {
        "weights": [p.detach().clone() for p in model.parameters()],
        "loss": float(mean_loss),
        "replicas": strategy.num_replicas_in_sync,
        "chief": strategy.extended.should_checkpoint,
        "replicas_equal": replicas_equal,
        "buckets": getattr(strategy.extended.components.gradient_sync, "buckets_in_shared_memory", []),
    }


def seed_example(rank: int, world: int):
    """The reference's reduce_to/update flow, across processes."""
    strategy = strategy_for(rank, world)
    with strategy.scope():
        v = unison.Variable(0.0)

    def step_fn(var):
        def merge_fn(strategy, value, var):
            reduced = strategy.extended.reduce_to(unison.ReduceOp.SUM, value, destinations=var)
            strategy.extended.update(var, lambda var, value: var.copy_(value), args=(reduced,))

        unison.get_replica_context().merge_call(merge_fn, args=(torch.tensor(1.0), var))

    strategy.run(step_fn, args=(v,))
    return float(v.values[0])


def chief_values_win(rank: int, world: int):
    torch.manual_seed(100 + rank)  # different init on every worker
    strategy = strategy_for(rank, world)
    with strategy.scope():
        model = nn.Linear(4, 3)
        v = unison.Variable(torch.full((2,), float(rank + 5)))
    return [p.detach().clone() for p in model.parameters()], v.values[0].clone()


def mismatched_all_reduce(rank: int, world: int):
    strategy = strategy_for(rank, world, timeout_seconds=20)
    value = torch.ones(3 if rank == 0 else 4)
    try:
        strategy.run(lambda: unison.get_replica_context().all_reduce("sum", value))
    except unison.errors.CollectiveMismatchError as exc:
        return type(exc).__name__, str(exc)
    return "no error", ""


def killed_mid_training(rank: int, world: int, timeout: float, implementation: str = "AUTO"):
    """Worker 1 kills itself at step 5; worker 0 reports what it raised, how long it waited,
    and whether its buckets were in shared memory."""
    strategy = strategy_for(rank, world, timeout_seconds=timeout, implementation=implementation)
    with strategy.scope():
        model = make_mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = strategy.extended.components.gradient_sync
    shared = all(sync.buckets_in_shared_memory)
    signals = getattr(sync.bucket_transport, "shared_counters", False)
    for step, (x, y) in enumerate(global_batches(steps=1000)):
        if rank == 1 and step == 5:
            os.kill(os.getpid(), signal.SIGKILL)
        started = time.monotonic()
        try:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
            opt.step()
        except unison.errors.PeerLostError as exc:
            return type(exc).__name__, str(exc), time.monotonic() - started, step, shared, signals
    return "no error", "", 0.0, -1, shared, signals


def check_worker_1_named(results: list, timeout: float, killed_at: int) -> tuple:
    """Asserts worker 1 died by SIGKILL and worker 0 raised PeerLostError naming it in time; returns the rest."""
    assert results[1].exitcode == -9
    kind, message, waited, step, *rest = results[0].value
    assert kind == "PeerLostError", message
    assert "worker:1" in message and "worker:0" not in message.split("missing task(s):")[1].split(";")[0]
    assert waited <= timeout + 10
    assert step >= killed_at
    return tuple(rest)


def grad_accumulation_and_unused(rank: int, world: int, implementation: str = "AUTO"):
    """no_sync accumulation equals one big batch; an unused parameter does not hang, and keeps
    no gradient (no worker computed one), as on one device."""
    strategy = strategy_for(rank, world, timeout_seconds=20, implementation=implementation)
    with strategy.scope():
        model = make_mlp()
        unused = nn.Linear(2, 2)
        opt = torch.optim.SGD(list(model.parameters()) + list(unused.parameters()), lr=0.1)
    x, y = global_batches(steps=1, batch=64)[0]
    xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
    halves = list(zip(xs.chunk(2), ys.chunk(2)))
    opt.zero_grad()
    with strategy.extended.no_sync():
        (nn.functional.cross_entropy(model(halves[0][0]), halves[0][1]) / 2).backward()
    (nn.functional.cross_entropy(model(halves[1][0]), halves[1][1]) / 2).backward()
    opt.step()
    return ([p.detach().clone() for p in model.parameters()], unused.weight.grad is None,
            all(strategy.extended.components.gradient_sync.buckets_in_shared_memory))


def sparse_embedding(rank: int, world: int):
    strategy = strategy_for(rank, world, timeout_seconds=20)
    with strategy.scope():
        torch.manual_seed(0)
        emb = nn.Embedding(10, 3, sparse=True)
        opt = torch.optim.SGD(emb.parameters(), lr=1.0)

    def step(ids):
        opt.zero_grad()
        emb(ids).sum().backward()
        grad = emb.weight.grad
        opt.step()
        return grad

    ids = torch.tensor([[1, 2], [3, 4]])[rank]
    strategy.run(step, args=(ids,))
    return emb.weight.detach().clone()


def _embedding_and_head(strategy: unison.Strategy, frozen: bool = False):
    """A sparse ``Embedding(10, 3)`` (made frozen if ``frozen``), a ``Linear(3, 1)`` head on its
    rows and SGD(lr=1) over both, built in ``strategy``'s scope; and ``step(ids, use)``, which
    differentiates the embedding where ``use`` is true and else reads its rows detached, and
    returns whether the embedding's gradient after the reduction is sparse."""
    with strategy.scope():
        torch.manual_seed(0)
        emb = nn.Embedding(10, 3, sparse=True)
        emb.weight.requires_grad_(not frozen)
        head = nn.Linear(3, 1)
        opt = torch.optim.SGD([*emb.parameters(), *head.parameters()], lr=1.0)

    def step(ids, use):
        opt.zero_grad()
        features = emb(ids) if use else emb.weight[ids].detach()
        head(features).sum().backward()
        grad = emb.weight.grad
        opt.step()
        return grad is not None and grad.is_sparse

    return emb, head, step


def sparse_embedding_on_one_worker(rank: int, world: int, implementation: str):
    """A sparse embedding only worker 0 differentiates (worker 1's batch reads its rows
    detached): worker 1 must still join the sparse all-reduce worker 0 makes."""
    strategy = strategy_for(rank, world, timeout_seconds=20, implementation=implementation)
    emb, head, step = _embedding_and_head(strategy)
    ids = torch.tensor([[1, 2], [3, 4]])[rank]
    sparse = strategy.run(step, args=(ids, rank == 0))
    return emb.weight.detach().clone(), head.weight.detach().clone(), head.bias.detach().clone(), sparse


def frozen_sparse_embedding_unfrozen(rank: int, world: int):
    """A sparse embedding made frozen, unfrozen at step 2, which only worker 0 uses in that step:
    the step that wakes it reduces it on both workers (the sparse sum, worker 1 with no rows)."""
    strategy = strategy_for(rank, world, timeout_seconds=20)
    emb, head, step = _embedding_and_head(strategy, frozen=True)
    ids = torch.tensor([[1, 2], [3, 4]])[rank]
    strategy.run(step, args=(ids, True))
    emb.weight.requires_grad_(True)
    strategy.run(step, args=(ids, rank == 0))
    return emb.weight.detach().clone(), head.weight.detach().clone()


def sparse_embedding_on_one_worker_of_two_devices(rank: int, world: int):
    """As ``sparse_embedding_on_one_worker`` with two local devices per worker: not supported
    there; the step's error says why and what to do."""
    strategy = strategy_for(rank, world, devices=["cpu:0", "cpu:1"], timeout_seconds=20)
    _, _, step = _embedding_and_head(strategy)
    try:
        strategy.run(step, args=(unison.PerReplica([torch.tensor([1, 2]), torch.tensor([3, 4])]), rank == 0))
    except unison.errors.CollectiveMismatchError as exc:
        return str(exc)
    return None


def sparse_sums(rank: int, world: int):
    """``all_reduce_sparse`` with no tensor on some workers: their sum in ``like``'s shape; None
    when no worker has one; the workers' sparse dimensions disagreeing: an error on every worker."""
    strategy = strategy_for(rank, world, timeout_seconds=20)
    ops = strategy.extended.cross_device_ops
    like = torch.zeros(4, 3)
    rows = torch.sparse_coo_tensor([[rank]], torch.ones(1, 3), (4, 3))
    summed = ops.all_reduce_sparse(rows if rank == 0 else None, like)
    nothing = ops.all_reduce_sparse(None, like)
    whole = torch.sparse_coo_tensor([[rank], [0]], [1.0], (4, 3))  # two sparse dimensions, not one
    try:
        ops.all_reduce_sparse(rows if rank == 0 else whole, like)
    except unison.errors.CollectiveMismatchError as exc:
        mismatch = str(exc)
    else:
        mismatch = None
    try:
        ops.all_reduce_sparse(None)  # refused before any collective: nothing to take the shape from
    except ValueError as exc:
        no_like = str(exc)
    return summed.to_dense(), summed.sparse_dim(), nothing, mismatch, no_like


def input_path_training(rank: int, world: int):
    """2 workers fed by experimental_distribute_dataset over the same global batches."""
    strategy = strategy_for(rank, world)
    with strategy.scope():
        model = make_mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    dataset = strategy.experimental_distribute_dataset(global_batches())

    def step(batch):
        x, y = batch
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        return x.shape[0]

    rows = [strategy.run(step, args=(batch,)) for batch in dataset]
    return [p.detach().clone() for p in model.parameters()], rows


def pipelines_from_function(rank: int, world: int):
    strategy = strategy_for(rank, world, devices=["cpu:0", "cpu:1"])
    seen = []

    def dataset_fn(context):
        seen.append((context.input_pipeline_id, context.num_input_pipelines, context.num_replicas_in_sync,
                     context.get_per_replica_batch_size(8)))
        base = 100 * context.input_pipeline_id
        # worker 1 has one more batch than worker 0: the loop must still end together
        count = 3 + context.input_pipeline_id
        return [torch.arange(base + 2 * i, base + 2 * i + 2) for i in range(2 * count)]

    dataset = strategy.distribute_datasets_from_function(dataset_fn)
    steps = []
    for batch in dataset:
        steps.append([v.tolist() for v in strategy.experimental_local_results(batch)])
    return seen, steps


class ShardedFiles:
    """A file-backed dataset (the FILE protocol): each 'file' is a list of global batches."""

    def __init__(self, files):
        self.files = list(files)

    def with_files(self, files):
        return [torch.full((4, 1), float(f)) for f in files for _ in range(int(f))]

    def __iter__(self):
        return iter(self.with_files(self.files))


def file_shards_end_together(rank: int, world: int):
    strategy = strategy_for(rank, world)
    dataset = strategy.experimental_distribute_dataset(
        ShardedFiles([1, 2, 3]), options=unison.InputOptions(auto_shard_policy=unison.AutoShardPolicy.FILE))
    steps = 0
    values = []
    for batch in dataset:
        steps += 1
        values.append(batch.flatten().tolist())
        strategy.reduce("sum", batch.sum())  # a collective per step: would hang if workers disagreed
    return steps, values


def gathers(rank: int, world: int):
    strategy = strategy_for(rank, world, devices=["cpu:0", "cpu:1"])

    def replica_fn():
        context = unison.get_replica_context()
        mine = torch.full((context.replica_id_in_sync_group + 1, 2), float(context.replica_id_in_sync_group))
        return mine, context.all_gather(torch.tensor([float(context.replica_id_in_sync_group)]), axis=0)

    per_replica, all_gathered = strategy.run(replica_fn)
    gathered = strategy.gather(per_replica, axis=0)
    summed = strategy.reduce("sum", per_replica, axis=0)
    return gathered, [t.tolist() for t in strategy.experimental_local_results(all_gathered)], summed


def clipped_training(rank: int, world: int):
    """Gradients read between backward() and step() are already reduced (clipping works)."""
    strategy = strategy_for(rank, world, timeout_seconds=20)
    with strategy.scope():
        model = make_mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
    norms = []
    for x, y in global_batches(steps=5):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)))
        opt.step()
    return [p.detach().clone() for p in model.parameters()], norms


class _Noisy(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("noise", torch.randn(3))


def buffers_from_chief(rank: int, world: int):
    torch.manual_seed(10 + rank)
    strategy = strategy_for(rank, world)
    with strategy.scope():
        module = _Noisy()
    torch.manual_seed(10)
    return module.noise.clone(), torch.randn(3)


def packed_batch_reduce(rank: int, world: int, implementation: str = "AUTO"):
    """A batch over LANE_SPLIT_BYTES plus mixed dtypes and shapes, SUM and MEAN.

    AUTO: through shared memory (the workers share a host); RING: gloo, two concurrent packs.
    """
    from unison._collectives.transport.packed_all_reduce import LANE_SPLIT_BYTES

    strategy = strategy_for(rank, world, timeout_seconds=30, implementation=implementation)

    def tensors_of(r: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(100 + r)
        big = [torch.randn(LANE_SPLIT_BYTES // 4 // 6, generator=g) for _ in range(8)]
        return big + [torch.randn(3, 5, generator=g), torch.tensor(float(r + 1)),
                      torch.arange(4, dtype=torch.int64) * (r + 1), torch.randn(2, 3, generator=g, dtype=torch.float64)]

    mine = tensors_of(rank)
    pairs = [(unison.PerReplica([t]), "cpu:0") for t in mine]
    sums = strategy.extended.batch_reduce_to("sum", pairs)
    means = strategy.extended.batch_reduce_to("mean", pairs)
    expected = [sum(parts) for parts in zip(*(tensors_of(r) for r in range(world)))]
    sum_error = max((s.double() - e.double()).abs().max().item() for s, e in zip(sums, expected))
    mean_error = max((m.double() - e.double() / world).abs().max().item() for m, e in zip(means, expected))
    shapes_kept = all(s.shape == t.shape and s.dtype == t.dtype for s, t in zip(sums, mine))
    transport = strategy.extended.cross_device_ops.transport.shared_memory
    used_shared_memory = transport is not None and bool(transport._segments)
    return sum_error, mean_error, shapes_kept, torch.equal(mine[0], tensors_of(rank)[0]), used_shared_memory


def mismatched_reduce_ops(rank: int, world: int, implementation: str):
    """Worker 0 sums, worker 1 averages the same tensor: both must raise, not mix the two."""
    strategy = strategy_for(rank, world, timeout_seconds=20, implementation=implementation)
    try:
        result = strategy.reduce("sum" if rank == 0 else "mean", torch.tensor([1.0, 2.0]))
    except unison.errors.CollectiveMismatchError as exc:
        return type(exc).__name__, str(exc)
    return "no error", result.tolist()


def skipped_reduce(rank: int, world: int, implementation: str):
    """Worker 1 skips one reduce; the next pair of same-shaped calls must not be paired silently."""
    strategy = strategy_for(rank, world, timeout_seconds=20, implementation=implementation)
    results = []
    try:
        if rank == 0:
            results.append(strategy.reduce("sum", torch.tensor([1.0])).item())
        results.append(strategy.reduce("sum", torch.tensor([10.0])).item())
    except unison.errors.CollectiveMismatchError as exc:
        return type(exc).__name__, str(exc)
    return "no error", results


def mismatch_after_shared_counters(rank: int, world: int, which: str):
    """A skipped reduce (``which="skipped"``), different reduce ops (``"ops"``) or a reduce against a
    gather (``"gather"``), once a first reduce made the host's shared counters: the per-call
    check's signatures then meet there, not in gloo."""
    strategy = strategy_for(rank, world, timeout_seconds=20)
    first = strategy.reduce("sum", torch.tensor([float(rank + 1)])).item()
    shared = strategy.extended.components.cross_device_ops.transport.call_signals() is not None
    try:
        if which == "skipped":
            if rank == 0:
                strategy.reduce("sum", torch.tensor([1.0]))
            strategy.reduce("sum", torch.tensor([10.0]))
        elif which == "gather":
            if rank == 0:
                strategy.reduce("sum", torch.tensor([1.0]))
            else:
                strategy.gather(torch.tensor([1.0]), axis=0)
        else:
            strategy.reduce("sum" if rank == 0 else "mean", torch.tensor([1.0, 2.0]))
    except unison.errors.CollectiveMismatchError as exc:
        return first, shared, type(exc).__name__, str(exc)
    return first, shared, "no error", ""


def bucket_order_over_gloo(rank: int, world: int):
    """``make_mlp(2)`` (hidden layers made first) over gloo with 64-byte buckets: the buckets'
    parameters (by name) before and after the first step, backward's gradient order, and the
    weights after training."""
    strategy = strategy_for(rank, world, implementation="RING", bytes_per_pack=64)
    with strategy.scope():
        model = make_mlp(2, 16)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    names = {id(p): n for n, p in model.named_parameters()}
    sync = strategy.extended.components.gradient_sync
    arrived = []
    hooks = [p.register_post_accumulate_grad_hook(lambda p: arrived.append(names[id(p)])) for p in model.parameters()]

    def buckets():
        return [[names[id(p)] for p in bucket.params] for bucket in sync._buckets]

    def step(x, y):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    before = buckets()
    for i, (x, y) in enumerate(global_batches()):
        strategy.run(step, args=(x.chunk(world)[rank], y.chunk(world)[rank]))
        if i == 0:
            first_order = list(arrived)
            for hook in hooks:
                hook.remove()
    return {"before": before, "after": buckets(), "gradient_order": first_order,
            "weights": [p.detach().clone() for p in model.parameters()]}


def dropped_model_leaves_the_buckets(rank: int, world: int, implementation: str, asymmetric: bool):
    """Trains a model, drops it (``asymmetric``: worker 1 keeps a reference), builds and trains
    another: the dropped one is released and no longer all-reduced; the new one trains as
    single-device. Returns (old model released, its weights unchanged by the new training,
    the new model's weights, the parameters left in the gradient buckets)."""
    strategy = strategy_for(rank, world, implementation=implementation)
    old, old_step = mlp_and_step(strategy, extra_layers=3)
    batches = global_batches()
    x, y = batches[0]
    strategy.run(old_step, args=(x.chunk(world)[rank], y.chunk(world)[rank]))
    released = weakref.ref(old[0].weight)
    kept = old if asymmetric and rank == 1 else None
    kept_weights = [p.detach().clone() for p in old.parameters()]
    del old, old_step
    gc.collect()
    model, step = mlp_and_step(strategy)  # a scope that makes variables: the workers agree on what is alive
    for x, y in batches:
        strategy.run(step, args=(x.chunk(world)[rank], y.chunk(world)[rank]))
    in_buckets = strategy.extended.components.gradient_sync.parameters_in_buckets
    untouched = kept is None or all(torch.equal(p, w) for p, w in zip(kept.parameters(), kept_weights))
    return (released() is None or kept is not None, untouched, [p.detach().clone() for p in model.parameters()],
            in_buckets)


def _train_freezing_the_first_layer(model, run_step, rank: int, world: int):
    """AdamW with weight decay; after 5 steps the first layer is frozen (requires_grad_(False))."""
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.5)

    def step(x, y):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    for i, (x, y) in enumerate(global_batches()):
        if i == 5:
            model[0].requires_grad_(False)
        run_step(step, x.chunk(world)[rank], y.chunk(world)[rank])
    return [p.detach().clone() for p in model.parameters()], model[0].weight.grad is None


def frozen_layer_training(rank: int, world: int, implementation: str):
    """The frozen layer must get no gradient (AdamW's decay would move it): as on one device."""
    strategy = strategy_for(rank, world, implementation=implementation)
    with strategy.scope():
        model = make_mlp(extra_layers=10)  # 24 small gradients: the bucket's flat slots are in use by step 5
    return _train_freezing_the_first_layer(model, lambda step, x, y: strategy.run(step, args=(x, y)), rank, world)


def single_device_frozen_layer_training():
    return _train_freezing_the_first_layer(make_mlp(extra_layers=10), lambda step, x, y: step(x, y), 0, 1)


class TwoHeads(nn.Module):
    """A trunk of 11 small layers and two heads (enough gradients for a bucket's flat slots)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        layers = [nn.Linear(8, 16)] + [nn.Linear(16, 16) for _ in range(9)]
        self.trunk = nn.Sequential(*[m for layer in layers for m in (layer, nn.ReLU())])
        self.heads = nn.ModuleList([nn.Linear(16, 4), nn.Linear(16, 4)])

    def forward(self, x, heads):
        features = self.trunk(x)
        return sum(self.heads[h](features) for h in heads)


def _train_two_heads(model, run_step, rank: int, world: int):
    """AdamW with weight decay; steps 0-4 use both heads, then one head per step, alternating
    (on every worker): a head a step skips must keep no gradient, as on one device, or
    AdamW's decay and moments would move it."""
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.5)

    def step(x, y, heads):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x, heads), y).backward()
        opt.step()
        return [h for h in (0, 1) if model.heads[h].weight.grad is None]

    skipped = []
    for i, (x, y) in enumerate(global_batches()):
        heads = (0, 1) if i < 5 else (i % 2,)
        skipped.append(run_step(step, x.chunk(world)[rank], y.chunk(world)[rank], heads))
    return [p.detach().clone() for p in model.parameters()], skipped


def two_heads_training(rank: int, world: int, implementation: str):
    strategy = strategy_for(rank, world, implementation=implementation)
    with strategy.scope():
        model = TwoHeads()
    return _train_two_heads(model, lambda step, x, y, h: strategy.run(step, args=(x, y, h)), rank, world)


def single_device_two_heads_training():
    return _train_two_heads(TwoHeads(), lambda step, x, y, h: step(x, y, h), 0, 1)


def _train_with_grad_scaler(strategy, rank: int, world: int, local_devices: int):
    """Mixed-precision style training with ``torch.amp.GradScaler`` (unscale, clip, step,
    update); step 7's batch overflows in its last rows (the last worker's, last replica's
    share). Returns the weights and the scale after each step."""
    torch.manual_seed(0)
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = make_mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=3)

    def step(x, y):
        opt.zero_grad()
        scaler.scale(nn.functional.cross_entropy(model(x), y)).backward()
        scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()

    batches = global_batches(steps=12, batch=16)
    batches[7][0][-1, 0] = float("inf")
    scales = []
    for x, y in batches:
        if strategy is None:
            step(x, y)
        else:
            xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
            if local_devices > 1:
                xs, ys = (unison.PerReplica(list(xs.chunk(local_devices))),
                          unison.PerReplica(list(ys.chunk(local_devices))))
            strategy.run(step, args=(xs, ys))
        scales.append(scaler.get_scale())
    return [p.detach().clone() for p in model.parameters()], scales


def grad_scaler_training(rank: int, world: int, local_devices: int):
    return _train_with_grad_scaler(strategy_for(rank, world, devices=[f"cpu:{i}" for i in range(local_devices)]),
                                   rank, world, local_devices)


def single_device_grad_scaler_training():
    return _train_with_grad_scaler(None, 0, 1, 1)


def lazy_model_training(rank: int, world: int, local_devices: int, dry_run_in_scope: bool):
    """A model of lazy layers, each worker drawing other weights (a seed per rank), its dry
    run inside or after scope: every worker must train the chief's weights."""
    strategy = strategy_for(rank, world, devices=[f"cpu:{i}" for i in range(local_devices)])
    torch.manual_seed(rank)
    with strategy.scope():
        model = nn.Sequential(nn.LazyLinear(16), nn.ReLU(), nn.LazyLinear(4))
        if dry_run_in_scope:
            model(torch.zeros(1, 8))
    if not dry_run_in_scope:
        model(torch.zeros(1, 8))
    with strategy.scope():
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(x, y):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    for x, y in global_batches(steps=8, batch=16):
        xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
        if local_devices > 1:
            xs, ys = unison.PerReplica(list(xs.chunk(local_devices))), unison.PerReplica(list(ys.chunk(local_devices)))
        strategy.run(step, args=(xs, ys))
    return [p.detach().clone() for p in model.parameters()]


def single_device_lazy_model_training():
    torch.manual_seed(0)  # the chief's seed
    model = nn.Sequential(nn.LazyLinear(16), nn.ReLU(), nn.LazyLinear(4))
    model(torch.zeros(1, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in global_batches(steps=8, batch=16):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


class _WithFrozenScale(nn.Module):
    """A layer and a scale made frozen (``requires_grad=False`` at construction), unfrozen at step 3."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(8, 4)
        self.scale = nn.Parameter(torch.full((4,), 0.5), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x) * self.scale


def _train_unfreezing(strategy: Any, rank: int, world: int, local_devices: int, in_step: bool):
    torch.manual_seed(0)
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = _WithFrozenScale()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(x, y, unfreeze):
        if unfreeze and in_step:
            model.scale.requires_grad_(True)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    for i, (x, y) in enumerate(global_batches(steps=8, batch=16)):
        if i == 3 and not in_step:
            model.scale.requires_grad_(True)
        if strategy is None:
            step(x, y, i == 3)
            continue
        xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
        if local_devices > 1:
            xs, ys = unison.PerReplica(list(xs.chunk(local_devices))), unison.PerReplica(list(ys.chunk(local_devices)))
        strategy.run(step, args=(xs, ys, i == 3))
    return [p.detach().clone() for p in model.parameters()]


def unfreezing_training(rank: int, world: int, local_devices: int, in_step: bool):
    return _train_unfreezing(strategy_for(rank, world, devices=[f"cpu:{i}" for i in range(local_devices)]),
                             rank, world, local_devices, in_step)


def single_device_unfreezing_training():
    return _train_unfreezing(None, 0, 1, 1, True)


def unfreezing_on_one_worker_only(rank: int, world: int) -> str:
    """Worker 0 alone unfreezes a parameter made frozen: the workers' collectives differ."""
    strategy = strategy_for(rank, world, timeout_seconds=5)
    with strategy.scope():
        model = _WithFrozenScale()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        for i, (x, y) in enumerate(global_batches(steps=4, batch=16)):
            if i == 1 and rank == 0:
                model.scale.requires_grad_(True)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
            opt.step()
    except unison.errors.PeerLostError as e:
        # Stay alive (heartbeating) until the peer's own wait has timed out and read the
        # heartbeats: a worker that returned at once could be gone by then under load, and
        # the peer would rightly call it missing instead of naming the likely cause.
        store = connect_rendezvous_store(timeout=30)
        store.set(f"unfreezing-error-{rank}", "1")
        store.wait([f"unfreezing-error-{(rank + 1) % world}"])
        return str(e)
    return "no error"
