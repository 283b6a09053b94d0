"""TorchRec training the DLRM of ``examples/dlrm.py`` on CPU with sharded tables (run by ``recsys.py``).

Usage: ``python _torchrec_dlrm.py --samples N --batch-size B --world-size W --rows R --eval-samples M --seed S``
with ``torchrec`` and ``fbgemm_gpu`` (the CPU build) importable (``PYTHONPATH`` = a
``pip install --target`` directory); prints one JSON line. What it measures: training
throughput (samples/s over all ranks) of N samples of ``ctr_data`` (seed S) and the
held-out AUC afterwards (M samples of seed S + 1).

W processes (gloo on 127.0.0.1, one intra-op thread each) hold a
``torchrec.models.dlrm.DLRM`` (bottom 13-64-16, the 351 pairwise dots of the 27 vectors
plus the bottom output, top 367-64-32-1, as ``examples/dlrm.py``) whose 26 tables
(R x 16, sum pooling, rows uniform in +-1/sqrt(16), ids by ``hashed_to_rows``) are
sharded by ``DistributedModelParallel`` (``--sharding``: table-wise, the default, or
row-wise, like a parameter server's split, which TorchRec 1.8 offers for CUDA only and
this script forces onto CPU through a sharder that lists it), their Adagrad fused into
the fbgemm CPU kernels (``apply_optimizer_in_backward``, ``EXACT_ADAGRAD``); the dense part is
data-parallel (DDP) with torch's Adagrad, fused (``fused=True``, as ``examples/ctr.py``'s dense
layers). Rank r trains on shard r of the data, batch B per rank (so W * B samples a synchronous
step), the first ``--warmup`` steps untimed. If TorchRec cannot shard or train here, the JSON
says why (``"error"``) and the exit status is 0.

``--data movielens`` trains on MovieLens-100k instead (``examples/movielens_data.py``: its
training split repeated ``--epochs`` times, the held-out split scored; ``--samples``,
``--rows`` and ``--eval-samples`` do not apply): 2 dense features, one table per feature of
exactly its cardinality (ids are the features' values, no hashing), the genres a bag of
variable length in the ``KeyedJaggedTensor`` (the padding left out), pooled by sum.
"""

import argparse
import json
import os
import queue as queue_lib
import resource
import socket
import sys
import time
import traceback
import warnings
from pathlib import Path

DIM = 16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _features(sparse, rows: int, keys: list):
    """A ``KeyedJaggedTensor`` of one id per feature per sample from ``[B, 26]`` id hashes."""
    import torch
    from ctr_data import hashed_to_rows
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    ids = hashed_to_rows(sparse, rows)
    return KeyedJaggedTensor(keys=keys, values=ids.t().contiguous().view(-1),
                             lengths=torch.ones(ids.numel(), dtype=torch.int32))


def _movielens_features(sparse, keys: list):
    """A ``KeyedJaggedTensor`` of MovieLens ``[B, 12]`` ids: each feature's values (the genres a bag of
    one to six, the padding left out), feature by feature, sample by sample."""
    import torch
    from movielens_data import FEATURE_WIDTHS, PADDING_ID, feature_values
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    values, lengths, start = [], [], 0
    for width in FEATURE_WIDTHS:
        columns = sparse[:, start:start + width]
        present = columns != PADDING_ID
        values.append(feature_values(columns)[present])  # row-major: sample by sample
        lengths.append(present.sum(1))
        start += width
    return KeyedJaggedTensor(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths).int())


def _schema(args: argparse.Namespace, rank: int, world: int):
    """``(keys, rows per table, dense features, training data, held-out data, features of a batch)``."""
    if args.data == "movielens":
        from movielens_data import FEATURES, NUM_DENSE, load_movielens

        train, test = load_movielens(seed=args.seed)
        keys = list(FEATURES)
        return (keys, list(train.cardinalities), NUM_DENSE,
                train.repeat(args.epochs, seed=args.seed).shard(rank, world), test.shard(rank, world),
                lambda sparse: _movielens_features(sparse, keys))
    from ctr_data import NUM_DENSE, NUM_SPARSE, make_ctr_data

    keys = [f"f{f}" for f in range(NUM_SPARSE)]
    return (keys, [args.rows] * NUM_SPARSE, NUM_DENSE, make_ctr_data(args.samples, seed=args.seed).shard(rank, world),
            make_ctr_data(args.eval_samples, seed=args.seed + 1).shard(rank, world),
            lambda sparse: _features(sparse, args.rows, keys))


def _train(rank: int, args: argparse.Namespace, port: int, queue) -> None:
    if args.bind_cores:  # before torch starts a thread: rank r on its CPUs, as unison launch binds task r
        from unison._launch.core_binding import plan_cores

        os.sched_setaffinity(0, plan_cores(range(args.world_size))[rank])
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)  # TorchRec / c10d deprecation notes
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world_size)
    try:
        result = _run(rank, args, torch, dist, F)
    except Exception as e:  # noqa: BLE001 - reported, not hidden: the JSON carries it
        result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        queue.put(result)
        queue.close()
        queue.join_thread()  # flushed before the hard exit
        os._exit(0)  # the other rank may wait in a collective forever
    if rank == 0:
        queue.put(result)
    dist.destroy_process_group()


def _run(rank: int, args: argparse.Namespace, torch, dist, F) -> dict:
    from ctr_data import auc
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.types import ShardingType
    from torchrec.models.dlrm import DLRM
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    class _RowWiseCpuSharder(EmbeddingBagCollectionSharder):  # TorchRec lists row-wise for CUDA only
        def sharding_types(self, compute_device_type: str) -> list:
            return [ShardingType.ROW_WISE.value]

    began = time.perf_counter()
    world, batch = args.world_size, args.batch_size
    keys, rows, num_dense, data, test, features = _schema(args, rank, world)
    torch.manual_seed(args.seed)
    bound = DIM ** -0.5
    ebc = EmbeddingBagCollection(device=torch.device("meta"), tables=[
        EmbeddingBagConfig(name=f"t{f}", embedding_dim=DIM, num_embeddings=rows[f], feature_names=[key],
                           weight_init_min=-bound, weight_init_max=bound) for f, key in enumerate(keys)])
    model = DLRM(embedding_bag_collection=ebc, dense_in_features=num_dense, dense_arch_layer_sizes=[64, DIM],
                 over_arch_layer_sizes=[64, 32, 1], dense_device=torch.device("cpu"))
    apply_optimizer_in_backward(torch.optim.Adagrad, model.sparse_arch.parameters(), {"lr": args.lr, "eps": 1e-10})
    sharding = {"row_wise": ShardingType.ROW_WISE, "table_wise": ShardingType.TABLE_WISE}[args.sharding].value
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world, compute_device="cpu", local_world_size=world),
        constraints={f"t{f}": ParameterConstraints(sharding_types=[sharding]) for f in range(len(keys))})
    sharders = [_RowWiseCpuSharder()] if args.sharding == "row_wise" else None
    plan = planner.collective_plan(model, sharders, pg=dist.GroupMember.WORLD)
    model = DistributedModelParallel(module=model, device=torch.device("cpu"), plan=plan, sharders=sharders)
    dense_optimizer = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(model.named_parameters())),
                                            lambda params: torch.optim.Adagrad(params, lr=args.lr, fused=True))
    optimizer = CombinedOptimizer([model.fused_optimizer, dense_optimizer])

    batches = [(dense, features(sparse), labels) for dense, sparse, labels in data.batches(batch)]
    total = args.samples if args.data == "synthetic" else len(data) * world
    steps = min(_dist_min(len(batches), torch, dist), total // (world * batch))

    def step(dense, features, labels):
        optimizer.zero_grad()
        loss = F.binary_cross_entropy_with_logits(model(dense, features).squeeze(1), labels)
        loss.backward()
        optimizer.step()
        return loss.detach()

    model.train()
    for i in range(args.warmup):
        step(*batches[i])
    dist.barrier()
    start = time.perf_counter()
    for i in range(args.warmup, steps):
        loss = step(*batches[i])
    dist.barrier()
    elapsed = time.perf_counter() - start

    model.eval()
    with torch.no_grad():  # every rank scores its part (the sharded lookup needs all ranks); rank 0 gathers
        scores = torch.cat([model(dense, features(sparse)).squeeze(1)
                            for dense, sparse, _ in test.batches(4096, drop_last=False)])
    gathered = [None] * world
    dist.all_gather_object(gathered, (scores, test.labels, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))
    timed = (steps - args.warmup) * batch * world
    import fbgemm_gpu
    import torchrec

    return {"system": "torchrec_cpu", "samples_per_s": timed / elapsed, "train_seconds": elapsed,
            "setup_seconds": start - began,
            "auc": auc(torch.cat([g[0] for g in gathered]), torch.cat([g[1] for g in gathered])),
            "samples": steps * batch * world, "timed_samples": timed, "batch_size_per_rank": batch,
            "world_size": world, "ps": None, "rows": rows if args.data == "movielens" else rows[0],
            "data": args.data, "sharding": args.sharding, "last_loss": loss.item(),
            "worker_peak_rss_mb": max(g[2] for g in gathered) / 1024, "ps_peak_rss_mb": None,
            "torchrec": torchrec.__version__, "fbgemm_gpu": fbgemm_gpu.__version__, "torch": torch.__version__}


def _dist_min(value: int, torch, dist) -> int:
    """The smallest ``value`` over the ranks (every rank must take the same number of steps)."""
    t = torch.tensor([value])
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("samples", 200_000), ("batch-size", 256), ("world-size", 2), ("rows", 200_000),
                          ("eval-samples", 50_000), ("seed", 0), ("warmup", 10)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--sharding", choices=("row_wise", "table_wise"), default="table_wise")
    parser.add_argument("--data", choices=("synthetic", "movielens"), default="synthetic")
    parser.add_argument("--epochs", type=int, default=1, help="movielens: passes over the training split")
    parser.add_argument("--bind-cores", action="store_true",
                        help="each rank on CPUs of its own (as unison launch --bind-cores binds its tasks)")
    args = parser.parse_args()
    if args.bind_cores:
        from unison._launch.core_binding import plan_cores

        try:
            plan_cores(range(args.world_size))  # refused here, before any rank starts, where a rank gets no CPU
        except ValueError as e:
            parser.error(str(e))
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))  # ctr_data, also in the ranks
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    try:
        import torchrec  # noqa: F401 - fail here, with the reason, rather than in the ranks
    except Exception as e:  # noqa: BLE001
        print(json.dumps({"system": "torchrec_cpu", "error": f"{type(e).__name__}: {e}"}), flush=True)
        return
    port = _free_port()
    procs = [ctx.Process(target=_train, args=(rank, args, port, queue)) for rank in range(args.world_size)]
    for p in procs:
        p.start()
    while True:  # a rank's result or error, or the exit codes of ranks that died without one
        try:
            result = queue.get(timeout=5)
            break
        except queue_lib.Empty:
            codes = [p.exitcode for p in procs]
            if any(code not in (None, 0) for code in codes) or None not in codes:
                try:
                    result = queue.get(timeout=1)
                except queue_lib.Empty:
                    result = {"error": f"a rank exited without reporting; exit codes {codes}"}
                break
    for p in procs:
        p.join(timeout=5 if "error" in result else 60)
        if p.is_alive():
            p.kill()
    print(json.dumps({"system": "torchrec_cpu", **result}), flush=True)


if __name__ == "__main__":
    main()
