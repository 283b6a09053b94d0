"""Click-through prediction at recommendation scale: a DLRM with dynamic embedding rows on ps tasks.

Run (hybrid: dense layers all-reduced every step, embedding rows on the ps tasks)::

    unison launch --workers 2 --ps 2 examples/ctr.py

(on one host, ``--ps-in-workers`` has each worker serve one ps task in its own process: no
ps processes, less CPU a step; add ``--bind-cores`` on a machine of its own, each worker then
on CPUs of its own: 1.15x faster on 2 cores), or asynchronous parameter servers (a chief
schedules steps onto the workers)::

    unison launch --chief --workers 2 --ps 2 examples/ctr.py --strategy ps

or one device: ``python examples/ctr.py --strategy one_device``. Real data: ``--data movielens``
trains on MovieLens-100k (``movielens_data.py``: a rating of 4 or 5 is a click; user, movie,
user attributes and a bag of genres; each user's last 20% of ratings held out), ``--epochs
N`` passes over its 80,000 training ratings. Table policies:
``--admit-after N`` gives an id a row only once seen ``N`` times (most ids of the stream
are rare), ``--capacity N`` keeps at most ``N`` rows (least recently used evicted).
Checkpoints and serving: ``--checkpoint-dir DIR --delta-every N`` writes the table every
``N`` steps as a chain (a full save point, then ``--full-every K`` deltas holding only the
rows changed since the save before, then a full one again; the dense layers whole each
time), and ``--export-dir DIR`` writes a serving export of the rows at the end
(``unison.embeddings.export_for_serving``; read it with ``ServingEmbedding.load``).

The data is made here (``ctr_data.py``): the Criteo Kaggle schema, 13 dense counts and
26 categorical features whose ids are 64-bit hashes with power-law frequencies, clicks
from a hidden model. The model (``dlrm.py``) is a DLRM: bottom MLP, one
``unison.DynamicEmbedding`` holding every feature's rows (made on first touch from the id
alone, so no vocabulary is fixed in advance), pairwise dot interaction, top MLP; Adagrad,
whose state for each row sits beside it on the ps. Every strategy prints the held-out
AUC and samples/s; the same code trains on a laptop and on a cluster.

``--optimizer`` picks how the rows train (their state sits beside each row):
``adagrad`` (the default) and ``rowwise_adagrad`` (one accumulator per row) train the
whole model with ``torch.optim.Adagrad``; ``sparse_adam`` trains the rows with
``torch.optim.SparseAdam`` (only touched rows move) and the dense layers with
``torch.optim.Adam``, its dense twin; ``ftrl`` trains the rows with ``unison.optim.Ftrl``
(TensorFlow's FTRL-Proximal, the classic optimizer of CTR models' sparse weights) and the
dense layers with Adagrad: FTRL's weights follow its linear terms alone, so a layer's
random start is forgotten at its first step, and an MLP stepped by it from its first step
collapses to a symmetric one (AUC 0.5 here); it suits the wide, sparse part, as in
TensorFlow's wide-and-deep models.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ctr_data import NUM_DENSE, NUM_SPARSE, CtrData, auc, bayes_auc, make_ctr_data  # noqa: E402
from dlrm import DLRM, dynamic_table  # noqa: E402
from movielens_data import MovieLensData  # noqa: E402

import unison  # noqa: E402


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=("hybrid", "ps", "one_device"), default="hybrid")
    parser.add_argument("--data", choices=DATA, default="synthetic",
                        help="synthetic Criteo-schema clicks (ctr_data.py) or MovieLens-100k (movielens_data.py)")
    parser.add_argument("--train", type=int, default=200_000,
                        help="synthetic: training samples over all workers (one pass)")
    parser.add_argument("--test", type=int, default=50_000, help="synthetic: held-out samples")
    parser.add_argument("--epochs", type=int, default=1,
                        help="movielens: passes over the 80,000 training ratings (each in its own order)")
    parser.add_argument("--batch-size", type=int, default=256, help="per worker (one device: per step)")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adagrad",
                        help="how the rows train (the dense layers: Adam beside sparse_adam, else Adagrad)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write the result here (the benchmark reads it)")
    parser.add_argument("--shard", default="0/1", help="one device: train on shard I of N of the samples (I/N)")
    parser.add_argument("--admit-after", type=int, default=None, metavar="N",
                        help="an id gets a row once seen N times in training (AdmitAfter(N)); default: at once")
    parser.add_argument("--capacity", type=int, default=None, metavar="N",
                        help="at most N rows after each step, least recently used evicted (on M ps tasks "
                             "ceil(N/M) each); default: no limit")
    parser.add_argument("--checkpoint-dir", type=Path, default=None, help="write table checkpoints here")
    parser.add_argument("--delta-every", type=int, default=None, metavar="N",
                        help="with --checkpoint-dir: a checkpoint of the table every N steps, by delta")
    parser.add_argument("--full-every", type=int, default=10, metavar="K",
                        help="deltas between two full checkpoints of the table (default 10)")
    parser.add_argument("--export-dir", type=Path, default=None,
                        help="write a serving export of the table (ids and rows) here at the end")
    args = parser.parse_args(argv)
    if args.delta_every is not None and (args.delta_every < 1 or args.checkpoint_dir is None):
        parser.error(f"--delta-every must be >= 1 and needs --checkpoint-dir, got --delta-every {args.delta_every} "
                     f"with --checkpoint-dir {args.checkpoint_dir}")
    if args.full_every < 0:
        parser.error(f"--full-every must be >= 0, got {args.full_every}")
    return args


class TableSaves:
    """``--checkpoint-dir``/``--delta-every``/``--full-every``/``--export-dir``: the table saved by delta
    every N steps (files ``step-<n>-full.pt`` / ``step-<n>-delta.pt``, atomic, on the chief), and a
    serving export at the end. Call from one process only (the chief; under the hybrid strategy, worker
    0): each save moves the table's chain. Load a chain with ``load_state_dict`` (the full file's
    ``"table"``) then ``load_delta_state_dict`` for each delta after it, in step order."""

    def __init__(self, args: argparse.Namespace, model: DLRM):
        self.args, self.model, self.deltas = args, model, None

    def after_step(self, step: int) -> None:
        every = self.args.delta_every
        if every is None or step % every:
            return
        full = self.deltas is None or self.deltas >= self.args.full_every
        table = self.model.embeddings.delta_state_dict(full=full)
        dense = {name: value.detach() for name, value in [*self.model.named_parameters(), *self.model.named_buffers()]
                 if not name.startswith("embeddings.")}
        path = self.args.checkpoint_dir / f"step-{step:08d}-{'full' if full else 'delta'}.pt"
        unison.save_checkpoint({"step": step, "table": table, "dense": dense}, path)
        self.deltas = 0 if full else self.deltas + 1

    def at_end(self) -> None:
        if self.args.export_dir is not None:
            path = unison.embeddings.export_for_serving(self.model.embeddings, self.args.export_dir)
            print(f"serving export of {self.model.embeddings.num_rows} rows: {path}")


def _policies(args: argparse.Namespace) -> dict:
    """The table policies the flags ask for (their values are checked by DynamicEmbedding, naming the field)."""
    policies: dict = {}
    if args.admit_after is not None:
        policies["admission"] = unison.embeddings.AdmitAfter(args.admit_after)
    if args.capacity is not None:
        policies["capacity"] = args.capacity
    return policies


OPTIMIZERS = ("adagrad", "rowwise_adagrad", "sparse_adam", "ftrl")
DATA = ("synthetic", "movielens")
Data = CtrData | MovieLensData


def _training_data(data: str, train: int, epochs: int, seed: int) -> Data:
    """The training samples, in the order they are trained on (sharded by the caller)."""
    if data == "movielens":
        from movielens_data import load_movielens

        return load_movielens(seed=seed)[0].repeat(epochs, seed=seed)
    return make_ctr_data(train, seed=seed)


def _test_data(args: argparse.Namespace) -> Data:
    if args.data == "movielens":
        from movielens_data import load_movielens

        return load_movielens(seed=args.seed)[1]
    return make_ctr_data(args.test, seed=args.seed + 1)


def _schema(data: str) -> dict:
    """The DLRM's arguments that follow the data: dense features, columns per sparse feature, padding."""
    if data == "movielens":
        import movielens_data

        return {"num_dense": movielens_data.NUM_DENSE, "feature_widths": movielens_data.FEATURE_WIDTHS,
                "padding_id": movielens_data.PADDING_ID}
    return {"num_dense": NUM_DENSE, "feature_widths": (1,) * NUM_SPARSE}


def _model(args: argparse.Namespace) -> tuple[DLRM, list[torch.optim.Optimizer]]:
    torch.manual_seed(args.seed)
    table = dynamic_table(args.dim, seed=args.seed, row_wise_adagrad=args.optimizer == "rowwise_adagrad",
                          **_policies(args))
    model = DLRM(table, embedding_dim=args.dim, bottom=(64, args.dim), **_schema(args.data))
    return model, _optimizers(model, args.optimizer, args.lr)


def _optimizers(model: DLRM, name: str, lr: float) -> list[torch.optim.Optimizer]:
    """The optimizers of one step: Adagrad for the whole model, or the rows' optimizer beside the dense
    layers' (SparseAdam takes sparse gradients only, and Adam over the rows is refused, naming SparseAdam;
    FTRL forgets a dense layer's random start: see the module). The dense layers step fused (``fused=True``:
    one kernel for all of them; Adagrad's step took 170 us a step unfused, 65 fused); the rows are stepped
    by the table, which reads only the optimizer's class and hyper-parameters."""
    if name in ("adagrad", "rowwise_adagrad"):  # the table keeps one accumulator per row or per value
        return [torch.optim.Adagrad(model.parameters(), lr=lr, fused=True)]
    rows = list(model.embeddings.parameters())
    dense = [p for p in model.parameters() if all(p is not r for r in rows)]
    if name == "sparse_adam":
        return [torch.optim.SparseAdam(rows, lr=lr), torch.optim.Adam(dense, lr=lr, fused=True)]
    return [unison.optim.Ftrl(rows, lr=lr), torch.optim.Adagrad(dense, lr=lr, fused=True)]


def _evaluate(model: DLRM, test: Data) -> float:
    model.eval()
    with torch.no_grad():
        scores = torch.cat([model(dense, sparse) for dense, sparse, _ in test.batches(8192, drop_last=False)])
    model.train()
    return auc(scores, test.labels)


def _report(args: argparse.Namespace, strategy: str, samples: int, seconds: float, test: Data, score: float,
            extra: dict | None = None) -> None:
    best = bayes_auc(test) if isinstance(test, CtrData) else None  # known for the synthetic data only
    result = {"strategy": strategy, "data": args.data, "optimizer": args.optimizer, "samples": samples,
              "seconds": seconds, "samples_per_s": samples / seconds, "auc": score, "bayes_auc": best, **(extra or {})}
    print(f"[{strategy}] trained on {samples} samples of {args.data} in {seconds:.1f} s "
          f"({samples / seconds:.0f} samples/s); held-out AUC {score:.4f}"
          + ("" if best is None else f" (Bayes-optimal {best:.4f})"))
    if args.json is not None:
        args.json.write_text(json.dumps(result))


def _step(model: DLRM, optimizers: list[torch.optim.Optimizer]):
    def step(dense: torch.Tensor, sparse: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = F.binary_cross_entropy_with_logits(model(dense, sparse), labels)
        for optimizer in optimizers:
            optimizer.zero_grad()
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()
        return loss.detach()
    return step


def one_device(args: argparse.Namespace) -> None:
    index, count = (int(part) for part in args.shard.split("/"))
    train = _training_data(args.data, args.train, args.epochs, args.seed).shard(index, count)
    test = _test_data(args)
    model, optimizers = _model(args)
    step = _step(model, optimizers)
    saves = TableSaves(args, model)
    start, samples = time.perf_counter(), 0
    for number, (dense, sparse, labels) in enumerate(train.batches(args.batch_size), start=1):
        step(dense, sparse, labels)
        samples += labels.numel()
        saves.after_step(number)
    saves.at_end()
    _report(args, "one_device", samples, time.perf_counter() - start, test, _evaluate(model, test),
            {"rows": model.embeddings.num_rows})


def hybrid(args: argparse.Namespace) -> None:
    resolver = unison.TFConfigClusterResolver()
    if resolver.task_type == "ps":
        unison.Server(resolver).join()  # holds rows until the launcher ends the job
        return
    strategy = unison.HybridParameterServerStrategy(resolver)
    rank, workers = strategy.extended.components.cluster.rank, strategy.num_replicas_in_sync  # chief first, if any
    data = _training_data(args.data, args.train, args.epochs, args.seed)
    steps = len(data) // workers // args.batch_size  # the same count on every worker
    train = data.shard(rank, workers)
    with strategy.scope():
        model, optimizers = _model(args)
    step = _step(model, optimizers)
    batches = train.batches(args.batch_size)
    saves = TableSaves(args, model)
    start = time.perf_counter()
    for number in range(1, steps + 1):
        strategy.run(step, args=next(batches))
        if args.delta_every is not None and number % args.delta_every == 0:
            strategy.join_pushes()  # the step's rows are on the ps tasks before worker 0 saves them
            if rank == 0:
                saves.after_step(number)
    strategy.join_pushes()  # every worker's pushes are on the ps tasks
    if rank == 0:
        saves.at_end()
    seconds = time.perf_counter() - start
    if rank == 0:
        test = _test_data(args)
        stats = model.embeddings.table_stats()
        print(f"[hybrid] rows per ps task: {[s['rows'] for s in stats]}, "
              f"MB: {[round(s['bytes'] / 2**20) for s in stats]}")
        _report(args, "hybrid", steps * args.batch_size * workers, seconds, test, _evaluate(model, test),
                {"rows_per_ps": [s["rows"] for s in stats], "table_bytes_per_ps": [s["bytes"] for s in stats],
                 "workers": workers})


def parameter_server(args: argparse.Namespace) -> None:
    resolver = unison.TFConfigClusterResolver()
    if resolver.task_type in ("worker", "ps"):
        unison.Server(resolver).join()
        return
    strategy = unison.ParameterServerStrategy(resolver)
    coordinator = unison.ClusterCoordinator(strategy)
    with strategy.scope():
        model, optimizers = _model(args)
    step = _step(model, optimizers)
    workers = len(strategy.ps_cluster.workers)
    batch, seed, total, name, epochs = args.batch_size, args.seed, args.train, args.data, args.epochs

    def dataset_fn(context: unison.InputContext):
        # repeated: a free worker takes the next step, so one may run more than its shard's share
        data = _training_data(name, total, epochs, seed)
        shard = data.shard(context.input_pipeline_id, context.num_input_pipelines)
        while True:
            yield from shard.batches(batch)

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
    size = len(_training_data(name, total, epochs, seed)) if name == "movielens" else total
    steps = size // workers // batch * workers

    def train_step(it):
        return step(*next(it))

    coordinator.schedule(train_step, args=(iterator,)).fetch()  # warm: connections, imports, datasets
    saves = TableSaves(args, model)
    start = time.perf_counter()
    for number in range(2, steps + 1):
        coordinator.schedule(train_step, args=(iterator,))
        if args.delta_every is not None and number % args.delta_every == 0:
            coordinator.join()  # the steps scheduled so far are done before the chief saves
            saves.after_step(number)
    coordinator.join()
    saves.at_end()
    seconds = time.perf_counter() - start
    test = _test_data(args)
    stats = model.embeddings.table_stats()
    print(f"[ps] rows per ps task: {[s['rows'] for s in stats]}, MB: {[round(s['bytes'] / 2**20) for s in stats]}")
    _report(args, "ps", (steps - 1) * batch, seconds, test, _evaluate(model, test),
            {"rows_per_ps": [s["rows"] for s in stats], "workers": workers})
    coordinator.shutdown()


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    {"hybrid": hybrid, "ps": parameter_server, "one_device": one_device}[args.strategy](args)


if __name__ == "__main__":
    main()
