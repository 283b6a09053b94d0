"""The compression suite of ``benchmarks/multi_host.py`` (issue 45), run inside each worker of a simulated host.

``train(workload, cfg, rank, world)``: builds, in this process and from one seed, the
model ten times -- unison's ``MultiWorkerMirroredStrategy`` on two hosts of two workers
(the hierarchical transport) exact and with ``compression="bf16"``, ``"fp16"``,
``PowerSGD(rank=1)`` and ``PowerSGD(rank=4)``; and ``DistributedDataParallel`` on the
same group exact and with DDP's own communication hooks for each -- then times them in
interleaved rounds. Compressed variants cannot equal DDP bit for bit; what each worker
reports instead is a digest of every variant's weights (the four workers must agree),
whether they are finite, and the largest weight difference to exact DDP after the same
steps on the same data, for unison's compression beside DDP's hook of the same kind.

``accuracy(cfg, rank, world)``: the digits of ``examples/digits.py`` (scikit-learn's,
nothing downloaded), trained the same number of steps exact and under each unison
compression from the same seed, on the same shards; held-out accuracy of each.

DDP's peers, and what differs from unison's settings:

- bf16: ``default_hooks._compress_hook(torch.bfloat16, ...)``, the body of DDP's
  ``bf16_compress_hook``, called under another name: DDP refuses the hook *by name*
  without CUDA and NCCL, and the body runs on gloo as it is;
- fp16: ``default_hooks.fp16_compress_hook``;
- PowerSGD: ``powerSGD_hook.PowerSGDState(matrix_approximation_rank=r,
  start_powerSGD_iter=START_ITER, min_compression_rate=2, use_error_feedback=True,
  warm_start=True)`` and ``powerSGD_hook``, as unison's ``PowerSGD(rank=r,
  start_iter=START_ITER, min_compression_rate=2)`` (error feedback and warm start are
  always on in unison). DDP's model gets one bucket for all gradients
  (``bucket_cap_mb=1000``): with several buckets on gloo, the hook's chained
  collectives (launched from future callbacks) met the other workers' in another order
  and gloo aborted ("Received data size doesn't match expected size"). unison also
  reduces a step's gradients together, when backward ends. Differences that remain:
  DDP orthonormalises ``P`` by Gram-Schmidt, unison by QR; their random initial ``Q``
  differ; DDP's half-type and PowerSGD hooks sum every worker's share over the 4-worker
  ring, unison sums a host's workers exactly in shared memory and compresses the sum
  that crosses hosts (bf16 / fp16), or sums the factors the same way (PowerSGD).
"""

from __future__ import annotations

import hashlib
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import interleaved_rounds  # noqa: E402

import unison  # noqa: E402
from multi_worker import _make_batches, _make_model, _make_step  # noqa: E402  (W1, W2 as everywhere)

START_ITER = 2
"""PowerSGD's exact steps first, for unison and DDP alike (the warm-up steps cover them)."""
UNISON = {"hier": "none", "hier_bf16": "bf16", "hier_fp16": "fp16", "hier_psgd1": 1, "hier_psgd4": 4}
"""unison's variants: the compression (an int: PowerSGD of that rank)."""
DDP = {"ddp": None, "ddp_bf16": "bf16", "ddp_fp16": "fp16", "ddp_psgd1": 1, "ddp_psgd4": 4}
"""DDP's variants, peer by peer: the hook (None: DDP's own exact all-reduce)."""
PEERS = dict(zip(UNISON, DDP))
VARIANTS = (*UNISON, *DDP)
GLOBAL_BATCHES = {"W1": 256, "W2": 256, "LM": 64}

# The TransformerEncoder language model (tests/real_models/test_transformer_encoder.py, larger)
VOCAB, WIDTH, LAYERS, HEADS, FEEDFORWARD, TOKENS = 1024, 128, 2, 4, 512, 32


class EncoderLM(nn.Module):
    """Token and position embeddings, a causal ``nn.TransformerEncoder``, a vocabulary head (2.6 MB of gradients)."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, WIDTH)
        self.positions = nn.Embedding(TOKENS, WIDTH)
        layer = nn.TransformerEncoderLayer(WIDTH, nhead=HEADS, dim_feedforward=FEEDFORWARD, dropout=0.0,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=LAYERS, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
        x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1]))
        return self.head(self.encoder(x, mask=mask, is_causal=True))


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def make_workload(name: str, count: int) -> tuple[Callable[[], nn.Module], list, Callable[..., torch.Tensor]]:
    """The model factory (seeded: every call the same weights), ``count`` global batches and the loss."""
    if name != "LM":
        batches, loss_fn = _make_batches(name, count)
        return (lambda: _make_model(name)), batches, loss_fn
    gen = torch.Generator().manual_seed(1234)
    # token streams with structure to learn: each next token a fixed function of the last, 1 in 4 replaced at random
    successor = torch.randperm(VOCAB, generator=gen)
    batches = []
    for _ in range(count):
        ids = torch.empty(GLOBAL_BATCHES["LM"], TOKENS + 1, dtype=torch.int64)
        ids[:, 0] = torch.randint(0, VOCAB, (ids.shape[0],), generator=gen)
        for t in range(TOKENS):
            noise = torch.randint(0, VOCAB, (ids.shape[0],), generator=gen)
            keep = torch.rand(ids.shape[0], generator=gen) < 0.75
            ids[:, t + 1] = torch.where(keep, successor[ids[:, t]], noise)
        batches.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))

    def model() -> nn.Module:
        torch.manual_seed(0)
        return EncoderLM()

    return model, batches, _lm_loss


def _unison(compression: str | int, timeout: float) -> unison.MultiWorkerMirroredStrategy:
    chosen: Any = unison.PowerSGD(rank=compression, start_iter=START_ITER, min_compression_rate=2) \
        if isinstance(compression, int) else compression
    options = unison.CommunicationOptions(timeout_seconds=timeout, compression=chosen)
    return unison.MultiWorkerMirroredStrategy(communication_options=options)


def bf16_hook(process_group, bucket):  # type: ignore[no-untyped-def]  # DDP checks real annotations, or none
    """DDP's ``bf16_compress_hook`` body (``_compress_hook(torch.bfloat16, ...)``): DDP refuses that
    hook by its name on a build without CUDA and NCCL, though gloo sums bfloat16 on CPU."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks._compress_hook(torch.bfloat16, process_group, bucket)


def _ddp(model: nn.Module, hook: str | int | None) -> nn.parallel.DistributedDataParallel:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if isinstance(hook, int):  # one bucket: several buckets' chained collectives abort gloo (module docstring)
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1000)
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=hook, start_powerSGD_iter=START_ITER,
            min_compression_rate=2, use_error_feedback=True, warm_start=True, random_seed=0)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return ddp
    ddp = nn.parallel.DistributedDataParallel(model)
    if hook == "bf16":
        ddp.register_comm_hook(None, bf16_hook)
    elif hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    return ddp


def _transport(strategy: unison.MultiWorkerMirroredStrategy) -> str:
    transport = strategy.extended.cross_device_ops.transport
    exact = getattr(transport, "exact", None)  # PowerSGD: the transport its sums take
    return type(transport).__name__ + (f" over {type(exact).__name__}" if exact is not None else "")


def _digest(model: nn.Module) -> str:
    with torch.no_grad():
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]


def _local(batches: list, rank: int, world: int) -> list:
    per = batches[0][0].shape[0] // world
    return [(x[rank * per:(rank + 1) * per].clone(), y[rank * per:(rank + 1) * per].clone()) for x, y in batches]


def train(workload: str, cfg: dict[str, Any], rank: int, world: int,
          counting: Callable[[Callable, list[int]], Callable]) -> dict[str, Any]:
    """Times every variant on ``workload``; the samples, transports, weight checks and how busy the cores were."""
    make_model, batches, loss_fn = make_workload(workload, cfg["num_batches"])
    local = _local(batches, rank, world)
    models: dict[str, nn.Module] = {}
    steps: dict[str, Callable] = {}
    transports = {}
    for name, compression in UNISON.items():
        strategy = _unison(compression, cfg["timeout"])
        transports[name] = _transport(strategy)
        with strategy.scope():
            models[name] = make_model()
            steps[name] = _make_step(models[name], torch.optim.SGD(models[name].parameters(), lr=0.01), loss_fn)
    for name, hook in DDP.items():
        ddp = _ddp(make_model(), hook)  # on the group unison formed
        models[name] = ddp.module
        steps[name] = _make_step(ddp, torch.optim.SGD(ddp.parameters(), lr=0.01), loss_fn)
    ticks = {name: [0, 0] for name in VARIANTS}
    samples, taken = interleaved_rounds({name: counting(steps[name], ticks[name]) for name in VARIANTS}, local, cfg)
    with torch.no_grad():
        exact = list(models["ddp"].parameters())
        diffs = {name: max((a - b).abs().max().item() for a, b in zip(models[name].parameters(), exact))
                 for name in VARIANTS}
        finite = {name: all(bool(torch.isfinite(p).all()) for p in models[name].parameters()) for name in VARIANTS}
        x, y = batches[0]
        losses = {name: loss_fn(models[name](x), y).item() for name in VARIANTS}  # the global batch 0, after training
    start_loss = loss_fn(make_model()(batches[0][0]), batches[0][1]).item()
    busy = {name: b / max(b + i, 1) for name, (b, i) in ticks.items()}
    return {"samples": samples, "steps_taken": taken, "cores_busy": busy, "transports": transports,
            "weight_diff_vs_ddp": diffs, "finite": finite, "digest": {n: _digest(m) for n, m in models.items()},
            "loss_batch0": losses, "loss_batch0_at_start": start_loss,
            "gradient_mb": sum(p.numel() * 4 for p in models["ddp"].parameters()) / 1e6}


def accuracy(cfg: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """Digits (examples/digits.py's data and CNN), exact and under each unison compression: held-out accuracy."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    from digits import load_digits, make_model  # noqa: PLC0415 - the example's own data and model

    epochs, batch, seeds = cfg["accuracy_epochs"], cfg["accuracy_batch"], cfg["accuracy_seeds"]
    results: dict[str, list[float]] = {name: [] for name in UNISON}
    transports = {}
    for seed in seeds:
        train_set, test_set = load_digits(seed)
        images, labels = train_set.tensors
        steps_per_epoch = len(labels) // batch
        per = batch // world
        for name, compression in UNISON.items():
            strategy = _unison(compression, cfg["timeout"])
            transports[name] = _transport(strategy)
            torch.manual_seed(seed)
            with strategy.scope():
                model = make_model()
                opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs)

            def step(x: torch.Tensor, y: torch.Tensor, model: nn.Module = model,
                     opt: torch.optim.Optimizer = opt) -> None:
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()

            order = torch.Generator().manual_seed(seed)
            for _ in range(epochs):
                perm = torch.randperm(len(labels), generator=order)
                for s in range(steps_per_epoch):
                    idx = perm[s * batch:(s + 1) * batch][rank * per:(rank + 1) * per]
                    strategy.run(step, args=(images[idx], labels[idx]))
                scheduler.step()
            with torch.no_grad():
                test_images, test_labels = test_set.tensors
                correct = (model(test_images).argmax(dim=1) == test_labels).float().mean().item()
            results[name].append(correct)
    return {"accuracy": results, "transports": transports, "test_digits": len(test_set),
            "steps": epochs * steps_per_epoch, "finite": all(math.isfinite(a) for r in results.values() for a in r)}
