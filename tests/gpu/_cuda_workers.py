"""Worker functions for the CUDA tests (module level, so the workers import them by name)."""

from __future__ import annotations

import contextlib

import torch

import unison
from tests.multi_worker._workers import global_batches, mlp_and_step


def _strategy(rank: int, world: int, devices, **options):
    spec = unison.ClusterSpec({"worker": [f"127.0.0.1:{i + 1}" for i in range(world)]})
    resolver = unison.SimpleClusterResolver(spec, task_type="worker", task_id=rank)
    return unison.MultiWorkerMirroredStrategy(resolver, unison.CommunicationOptions(timeout_seconds=60, **options),
                                              devices=devices)


def train_on_cuda(rank: int, world: int, implementation: str = "AUTO", compression: str = "none"):
    """The multi-worker MLP trained on ``cuda:0`` (every worker on the one GPU); the
    weights come back on the CPU with the group's backend and transport."""
    chosen = unison.PowerSGD(rank=1, start_iter=2, min_compression_rate=1) if compression == "powersgd" else compression
    strategy = _strategy(rank, world, ["cuda:0"], implementation=implementation, compression=chosen)
    model, step = mlp_and_step(strategy, 2, 16)
    for x, y in global_batches():
        strategy.run(step, args=(x.chunk(world)[rank].cuda(), y.chunk(world)[rank].cuda()))
    extended = strategy.extended
    return {"weights": [p.detach().cpu().clone() for p in model.parameters()],
            "devices": sorted({str(p.device) for p in model.parameters()}),
            "backend": extended.cross_device_ops.worker_group.backend,
            "transport": type(extended.cross_device_ops.transport).__name__}


def reduce_on_cuda(rank: int, world: int, implementation: str = "AUTO"):
    """Sum and mean of CUDA tensors across the workers through ``strategy.reduce`` and
    ``batch_reduce_to``; the results come back on the CPU with their devices."""
    strategy = _strategy(rank, world, ["cuda:0"], implementation=implementation)
    g = torch.Generator().manual_seed(rank)
    tensors = [torch.randn(1000, generator=g), torch.randn(7, 3, generator=g, dtype=torch.float64),
               torch.arange(4) * (rank + 1)]
    pairs = [(unison.PerReplica([t.cuda()]), "cuda:0") for t in tensors]
    means = strategy.extended.batch_reduce_to("mean", pairs)
    total = strategy.reduce("sum", unison.PerReplica([torch.full((3,), float(rank + 1), device="cuda:0")]), axis=None)
    return {"inputs": tensors, "means": [m.cpu() for m in means], "mean_devices": [str(m.device) for m in means],
            "sum": total.cpu(), "sum_device": str(total.device)}


def _real_model(name: str):
    """A small real model definition (torchvision ResNet-18 or a 2-layer GPT-2), built
    from seed 0, with its loss and batches (the same in every call)."""
    from tests.real_models import _harness as h

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1234)
    if name in ("resnet18", "resnet18_64"):  # at 32x32 the last stage's maps are 1x1
        model = h.import_torchvision().models.resnet18(num_classes=10)
        size = 64 if name == "resnet18_64" else 32
        batches = [(torch.randn(8, 3, size, size, generator=g), torch.randint(0, 10, (8,), generator=g))
                   for _ in range(4)]
        return model, batches, lambda m, x, y: torch.nn.functional.cross_entropy(m(x), y)
    if name == "gpt2":
        transformers = h.import_transformers()
        transformers.logging.set_verbosity_error()
        config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=97, n_positions=32,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                         bos_token_id=0, eos_token_id=0)
        batches = [(torch.randint(0, 97, (8, 16), generator=g),) for _ in range(4)]
        return transformers.GPT2LMHeadModel(config), batches, lambda m, ids: m(input_ids=ids, labels=ids).loss
    raise ValueError(f"name={name!r}: use 'resnet18', 'resnet18_64' or 'gpt2'")


def _train_real(model, batches, loss_fn, step_model=None, strategy=None):
    """4 SGD (momentum) steps over ``model``'s parameters, each running ``step_model``
    (default ``model``): in ``strategy.run`` with the optimizer made in its scope, or plainly."""
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    forward = model if step_model is None else step_model

    def step(*batch):
        opt.zero_grad()
        loss = loss_fn(forward, *batch)
        loss.backward()
        opt.step()
        return loss

    for batch in batches:
        args = tuple(t.cuda() for t in batch)
        if strategy is not None:
            strategy.run(step, args=args)
        else:
            step(*args)


def real_models_on_cuda(rank: int, world: int, cases):
    """Each ``(model, compiled)`` case trained 4 SGD steps on ``cuda:0`` as plain PyTorch
    (eager) and under MultiWorkerMirroredStrategy in an NCCL group of one (``compiled``:
    ``torch.compile`` with ``strategy.extended.compile_backend()``, inductor on the GPU);
    returns per case the largest |unison - plain| over the parameters, how far training
    moved them, and their devices -- or the error. A compiled case also compiles the plain
    model alone and under DDP (``plain_compiled``, ``ddp_compiled``: distance to eager plain,
    or the error), so a failure of torch's own compiler is told apart from unison's. cuDNN runs deterministic kernels
    without TF32, so eager runs are bit-comparable; inductor may reorder sums."""
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    strategy = _strategy(rank, world, ["cuda:0"], implementation="NCCL")
    out = {}
    for name, compiled in cases:
        case = out[f"{name}-{'compiled' if compiled else 'eager'}"] = {}
        plain, batches, loss_fn = _real_model(name)
        initial = [p.detach().clone() for p in plain.parameters()]
        plain.cuda()
        _train_real(plain, batches, loss_fn)
        case["moved"] = max(float((p.detach().cpu() - q).abs().max()) for p, q in zip(plain.parameters(), initial))
        try:
            with strategy.scope():
                model, batches, loss_fn = _real_model(name)
            step_model = torch.compile(model, backend=strategy.extended.compile_backend()) if compiled else model
            _train_real(model, batches, loss_fn, step_model=step_model, strategy=strategy)
            case["diff"] = _distance(model, plain)
            case["devices"] = sorted({str(p.device) for p in model.parameters()})
        except Exception as exc:  # noqa: BLE001 - reported to the test
            case["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
        torch._dynamo.reset()
        if compiled:  # after unison's step: the worker group exists, for DDP too
            case["plain_compiled"] = _compiled_control(name, plain, ddp=False)
            case["ddp_compiled"] = _compiled_control(name, plain, ddp=True)
    return out


def _compiled_control(name: str, plain, ddp: bool):
    """The plain model compiled with inductor (``ddp``: wrapped in DDP over the worker's
    NCCL group, so Dynamo's DDPOptimizer splits it as ``compile_backend`` splits unison's):
    its distance to eager ``plain`` after the same steps, or its error."""
    from torch.nn.parallel import DistributedDataParallel

    control, batches, loss_fn = _real_model(name)
    control.cuda()
    try:
        wrapped = DistributedDataParallel(control) if ddp else control
        _train_real(control, batches, loss_fn, step_model=torch.compile(wrapped))
        return _distance(control, plain)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return f"{type(exc).__name__}: {str(exc)[:400]}"
    finally:
        torch._dynamo.reset()


def _distance(model, reference) -> float:
    return max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(model.parameters(), reference.parameters()))
