"""Shared pieces of the real-model tests: optional imports, data shards, the DDP oracle.

Every case trains a real model definition (torchvision, Hugging Face Transformers, or
``nn.TransformerEncoder``; small configurations, random init, nothing downloaded) for a
few SGD steps twice in the same warm pool call: under PyTorch DDP (2 ranks on the pool's
gloo group, ``broadcast_buffers=False``) and under a unison strategy on the same data
shards, then reports how far unison's parameters and buffers are from DDP's.

* ``MultiWorkerMirroredStrategy``: worker ``r`` is compared with DDP rank ``r``.
* ``MirroredStrategy(["cpu:0", "cpu:1"])`` runs whole on rank 0 (replica threads in one
  process); replica ``i`` is compared with DDP rank ``i``. DDP ranks hold equal parameters;
  their buffers differ, since each BatchNorm normalises with its own replica's batch and
  keeps its own running statistics -- which is what unison does too (its README: buffers
  are per replica / per worker and never re-broadcast), hence ``broadcast_buffers=False``.

Both runs build the model from the same seed, and the worker reports how far apart the
two starting points were, so a case whose strategies do not start equal fails as such.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch import nn

import unison

INSTALL_HINT = "pip install 'torch==2.13.0' -e '.[models]'"
"""How the optional packages of these tests are installed (torch pinned in the same call)."""

ADDRESSES = ["127.0.0.1:1", "127.0.0.1:2"]  # never bound: the pool's gloo group is reused

SEED = 0
LR = 0.05
MOMENTUM = 0.9
TOLERANCE = 1e-5
"""Largest |unison - DDP| allowed for any parameter or buffer element (float32 round-off)."""

Batch = tuple[torch.Tensor, ...]
Builder = Callable[[], nn.Module]
LossFn = Callable[[nn.Module, Batch], torch.Tensor]


def requires(*packages: str) -> pytest.MarkDecorator:
    """Skips a test whose optional packages are not installed, naming them and the fix."""
    missing = [name for name in packages if importlib.util.find_spec(name) is None]
    return pytest.mark.skipif(
        bool(missing), reason=f"{', '.join(missing)} not installed (optional 'models' extra): {INSTALL_HINT}"
    )


_TORCHVISION_SCHEMAS: list[torch.library.Library] = []
"""The stand-in op definitions, held for the process's lifetime (dropping a ``Library``
removes what it defined)."""


def import_torchvision() -> Any:
    """Imports torchvision, also where its compiled ops cannot load.

    PyPI serves torchvision 0.28 for Linux only as a CUDA build; beside the CPU torch its
    ``_C.so`` cannot load (it links ``libc10_cuda.so``). torchvision tolerates that
    (``extension._has_ops()`` is False) except in ``_meta_registrations``, which registers
    fake kernels for ``torchvision::nms`` and ``torchvision::qnms`` unconditionally and so
    raises "operator torchvision::nms does not exist" -- failing ``import torchvision``
    and, through ``transformers.image_utils``, Transformers' model imports too. Defining
    just those two schemas (no kernel: calling them still raises) lets the pure-Python
    model definitions import. Where ``_C`` loads, nothing is defined.
    """
    try:
        return importlib.import_module("torchvision")
    except RuntimeError as exc:
        if "torchvision::" not in str(exc) or _TORCHVISION_SCHEMAS:
            raise
    for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
        del sys.modules[name]  # the half-imported package, to import again
    library = torch.library.Library("torchvision", "DEF")
    library.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    library.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _TORCHVISION_SCHEMAS.append(library)
    return importlib.import_module("torchvision")


def import_transformers() -> Any:
    """Imports transformers; torchvision first where installed (Transformers imports it)."""
    if importlib.util.find_spec("torchvision") is not None:
        import_torchvision()
    return importlib.import_module("transformers")


def global_batches(make: Callable[[torch.Generator], Batch], steps: int) -> list[Batch]:
    """``steps`` global batches drawn from a fixed generator (the same in every process)."""
    generator = torch.Generator().manual_seed(1234)
    return [make(generator) for _ in range(steps)]


def shard(batch: Batch, index: int, count: int) -> Batch:
    """Rows ``index`` of ``count`` equal chunks of every tensor of ``batch``."""
    return tuple(t.chunk(count)[index] for t in batch)


def _replica_values(tensor: torch.Tensor, replicas: int) -> list[torch.Tensor]:
    if isinstance(tensor, unison.DistributedValues):
        values = list(tensor.values)
        assert len(values) == replicas, f"{type(tensor).__name__} has {len(values)} components, not {replicas}"
        return [v.detach() for v in values]
    return [tensor.detach()] * replicas


def _state(model: nn.Module, replicas: int) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
    """Per replica: parameters by name, buffers by name (plain float copies)."""
    params: list[dict[str, torch.Tensor]] = [{} for _ in range(replicas)]
    buffers: list[dict[str, torch.Tensor]] = [{} for _ in range(replicas)]
    for target, named in ((params, model.named_parameters()), (buffers, model.named_buffers())):
        for name, tensor in named:
            for i, value in enumerate(_replica_values(tensor, replicas)):
                target[i][name] = value.as_subclass(torch.Tensor).clone().double()
    return params, buffers


def worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
    """Largest element-wise |got - want| over tensors of the same names, and its tensor's name."""
    assert got.keys() == want.keys(), f"names differ: {sorted(got.keys() ^ want.keys())}"
    return max([(float((got[n] - want[n]).abs().max()), n) for n in want if want[n].numel()], default=(0.0, ""))


def max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """Largest element-wise |got - want| over tensors of the same names (0.0 for none)."""
    return worst(got, want)[0]


def _train(model: nn.Module, step_model: nn.Module, loss_fn: LossFn, batches: Sequence[Batch]) -> float:
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    loss = torch.tensor(0.0)
    for batch in batches:
        opt.zero_grad()
        loss = loss_fn(step_model, batch)
        loss.backward()
        opt.step()
    return float(loss.detach())


def _ddp(rank: int, world: int, build: Builder, loss_fn: LossFn, batches: Sequence[Batch]):
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(SEED)
    model = build()
    initial, _ = _state(model, 1)
    with warnings.catch_warnings():  # torch 2.13 deprecates the name; its successor still syncs at init
        warnings.simplefilter("ignore", FutureWarning)
        ddp = DistributedDataParallel(model, broadcast_buffers=False)
    loss = _train(model, ddp, loss_fn, [shard(b, rank, world) for b in batches])
    del ddp  # drops its reference to the pool's group before unison uses it
    params, buffers = _state(model, 1)
    return initial[0], params[0], buffers[0], loss


def _unison(strategy: unison.Strategy, replicas: int, build: Builder, loss_fn: LossFn, batches: Sequence[Batch],
            shards_of: Callable[[Batch], Any]):
    with strategy.scope():
        torch.manual_seed(SEED)
        model = build()
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    initial, _ = _state(model, replicas)

    def step(*batch: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        opt.step()
        return loss

    loss = None
    for batch in batches:
        loss = strategy.run(step, args=shards_of(batch))
    params, buffers = _state(model, replicas)
    return initial, params, buffers, float(strategy.reduce("mean", loss).detach())


def compare(rank: int, world: int, strategy_kind: str, build: Builder, loss_fn: LossFn,
            make_batch: Callable[[torch.Generator], Batch], steps: int) -> dict[str, Any]:
    """Pool function: DDP on this rank's shards, then unison's ``strategy_kind`` on the same.

    Returns this rank's report: ``initial`` and ``params`` (largest |unison - DDP| at the
    start and after ``steps`` steps over every local replica, with the tensor's name),
    ``buffers`` (per local replica, to compare with DDP rank ``i``'s ``ddp_buffers``), and
    the last step's ``loss`` (unison's mean over replicas) and ``ddp_loss`` (this rank's).
    ``strategy_kind`` "mirrored" runs on rank 0 only (rank 1 reports DDP alone).
    """
    batches = global_batches(make_batch, steps)
    ddp_initial, ddp_params, ddp_buffers, ddp_loss = _ddp(rank, world, build, loss_fn, batches)
    report: dict[str, Any] = {"ddp_buffers": ddp_buffers, "ddp_loss": ddp_loss,
                              "ddp_moved": max_diff(ddp_params, ddp_initial)}
    if strategy_kind == "mwms":
        resolver = unison.SimpleClusterResolver(unison.ClusterSpec({"worker": ADDRESSES[:world]}),
                                                task_type="worker", task_id=rank)
        strategy: unison.Strategy = unison.MultiWorkerMirroredStrategy(resolver)
        replicas = 1
        shards_of: Callable[[Batch], Any] = lambda batch: shard(batch, rank, world)  # noqa: E731
    elif strategy_kind == "mirrored":
        if rank != 0:
            return report
        strategy = unison.MirroredStrategy([f"cpu:{i}" for i in range(world)])
        replicas = world
        shards_of = lambda batch: tuple(  # noqa: E731
            unison.PerReplica([shard(batch, i, world)[k] for i in range(world)]) for k in range(len(batch)))
    else:
        raise ValueError(f"strategy_kind={strategy_kind!r}: use 'mwms' or 'mirrored'")
    assert strategy.num_replicas_in_sync == world, strategy.num_replicas_in_sync
    initial, params, buffers, loss = _unison(strategy, replicas, build, loss_fn, batches, shards_of)
    report.update(
        initial=max(worst(p, ddp_initial) for p in initial),
        params=max(worst(p, ddp_params) for p in params),
        buffers=buffers,
        loss=loss,
    )
    return report


def check(results: list[dict[str, Any]], strategy_kind: str, label: str) -> dict[str, float]:
    """Asserts every replica's parameters, buffers and loss are DDP's within ``TOLERANCE``.

    Returns the largest differences (``initial``, ``params``, ``buffers``, ``loss``) and two
    facts about the oracle (``ddp_moved``: how far training moved DDP's parameters;
    ``ddp_rank_buffers``: how far its ranks' buffers differ), also printed with ``label``
    (``pytest -s`` shows the table of the real-model cases).
    """
    ddp_buffers = [r["ddp_buffers"] for r in results]
    if strategy_kind == "mwms":
        pairs = [(r["buffers"][0], ddp_buffers[rank]) for rank, r in enumerate(results)]
        reports = results
    else:
        pairs = [(b, ddp_buffers[i]) for i, b in enumerate(results[0]["buffers"])]
        reports = results[:1]
    ddp_loss = sum(r["ddp_loss"] for r in results) / len(results)
    initial, first_off = max(r["initial"] for r in reports)
    params, worst_param = max(r["params"] for r in reports)
    buffers, worst_buffer = max([worst(got, want) for got, want in pairs], default=(0.0, ""))
    diffs = {
        "initial": initial,
        "params": params,
        "buffers": buffers,
        "loss": abs(reports[0]["loss"] - ddp_loss),
        "ddp_moved": results[0]["ddp_moved"],
        "ddp_rank_buffers": max_diff(ddp_buffers[0], ddp_buffers[1]),
    }
    print(f"\n{label} {strategy_kind}: max |unison - DDP| params {params:.3g}, buffers {buffers:.3g}, "
          f"last loss {diffs['loss']:.3g} (initial {initial:.3g}; DDP moved {diffs['ddp_moved']:.3g}, "
          f"its ranks' buffers differ by {diffs['ddp_rank_buffers']:.3g})")
    assert diffs["ddp_moved"] > 1e-3, f"{label}: DDP training hardly moved the parameters ({diffs})"
    assert initial == 0.0, f"{label}: unison's {first_off!r} did not start from DDP's values ({diffs})"
    assert params <= TOLERANCE, (f"{label} {strategy_kind}: parameter {worst_param!r} is {params:.3g} off DDP's "
                                 f"({diffs})")
    assert buffers <= TOLERANCE, (f"{label} {strategy_kind}: buffer {worst_buffer!r} is {buffers:.3g} off DDP's "
                                  f"({diffs})")
    assert diffs["loss"] <= TOLERANCE * max(1.0, ddp_loss), f"{label} {strategy_kind}: losses differ ({diffs})"
    return diffs


def run_case(worker_pool: Any, strategy_kind: str, build: Builder, loss_fn: LossFn,
             make_batch: Callable[[torch.Generator], Batch], steps: int, label: str, timeout: float = 60.0):
    """One pool call (DDP and unison on the same shards), then ``check``."""
    results = worker_pool.run(compare, strategy_kind, build, loss_fn, make_batch, steps, timeout=timeout)
    return check(results, strategy_kind, label)
