"""TensorFlow's ParameterServerStrategy training the DLRM of ``examples/dlrm.py`` (run by ``recsys.py``).

Usage: ``python _tf_dlrm.py --samples N --batch-size B --num-ps P --rows R --eval-samples M --seed S``
with ``tensorflow`` importable (``PYTHONPATH`` = a ``pip install --target`` directory);
prints one JSON line. What it measures: training throughput (samples/s over both
workers) of N samples of ``ctr_data`` (seed S) and the held-out AUC afterwards (M
samples of seed S + 1), with the cluster of ``_tf_parameter_server.py``: chief + 2
workers + P ps, each in its own local process with one intra-op thread.

The model is plain TF: bottom MLP 13-64-16, 26 tables of R x 16 (ids by
``hashed_to_rows``, one id per feature), the 351 pairwise dots of the 27 vectors plus the
bottom output, top MLP 367-64-32-1, initialised as ``examples/dlrm.py`` (rows uniform in
+-1/sqrt(16), layers as ``nn.Linear``); Adagrad (``lr``, zero initial accumulator, as
torch's) by the fused ``ResourceSparseApplyAdagradV2`` / ``ResourceApplyAdagradV2`` ops,
whose accumulators are partitioned like their variables, so updates run on the ps (a
batch's repeated rows summed first). The tables are split by
``FixedShardsPartitioner(P)``; the dense variables stay whole. PSS gives every worker the
same dataset function, so each worker's iterator is taken from a dataset of its own shard
(a faster worker may wrap round its shard). Steps are asynchronous
(``coordinator.schedule``): N / B steps of batch B, the first ``--warmup`` untimed. Peak
RSS is each process's ``VmHWM``.
"""

import argparse
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _tf_parameter_server import _free_port, _serve  # noqa: E402  (the same cluster of servers)

DIM, BOTTOM, TOP = 16, (13, 64, 16), (367, 64, 32, 1)


def _peak_rss_mb(pid: int) -> "float | None":
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmHWM"))
    except (OSError, StopIteration):
        return None


def _arrays(n: int, seed: int, rows: int):
    """``ctr_data``'s samples as numpy: dense float32, row ids int64 [n, 26], labels float32."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    import ctr_data

    data = ctr_data.make_ctr_data(n, seed=seed)
    return data.dense.numpy(), ctr_data.hashed_to_rows(data.sparse, rows).numpy(), data.labels.numpy(), ctr_data


def _dataset_fn(tf, part: tuple, batch: int):
    """A function without arguments (as PSS wants) making the repeated batches of ``part``."""
    return lambda: tf.data.Dataset.from_tensor_slices(part).batch(batch, drop_remainder=True).repeat()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("samples", 200_000), ("batch-size", 256), ("num-ps", 2), ("rows", 200_000),
                          ("eval-samples", 50_000), ("seed", 0), ("warmup", 10)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()
    began = time.perf_counter()
    num_ps, batch, rows = args.num_ps, args.batch_size, args.rows
    dense, ids, labels, ctr_data = _arrays(args.samples, args.seed, rows)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # the servers inherit it
    cluster = {"worker": [f"127.0.0.1:{_free_port()}" for _ in range(2)],
               "ps": [f"127.0.0.1:{_free_port()}" for _ in range(num_ps)],
               "chief": [f"127.0.0.1:{_free_port()}"]}
    ctx = multiprocessing.get_context("spawn")
    procs = {(job, i): ctx.Process(target=_serve, args=(cluster, job, i), daemon=True)
             for job in ("worker", "ps") for i in range(len(cluster[job]))}
    for p in procs.values():
        p.start()
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster), task_type="chief", task_id=0, rpc_layer="grpc")
    fixed = tf.distribute.experimental.partitioners.FixedShardsPartitioner(num_ps)

    def partitioner(shape, dtype):  # the tables only; dense weights stay whole
        return fixed(shape, dtype) if shape[0] == rows and shape[1] == DIM else [1] * shape.rank

    strategy = tf.distribute.ParameterServerStrategy(resolver, variable_partitioner=partitioner)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    init = np.random.default_rng(args.seed)

    def uniform(shape, bound):
        return init.uniform(-bound, bound, shape).astype(np.float32)

    def linears(sizes):  # torch.nn.Linear's default initialisation
        return [tf.Variable(uniform(shape, fan_in ** -0.5)) for fan_in, fan_out in zip(sizes, sizes[1:])
                for shape in ((fan_in, fan_out), (fan_out,))]

    with strategy.scope():
        tables = [tf.Variable(uniform((rows, DIM), DIM ** -0.5)) for _ in range(ctr_data.NUM_SPARSE)]
        table_accs = [tf.Variable(tf.zeros((rows, DIM))) for _ in tables]
        dense_vars = linears(BOTTOM) + linears(TOP)
        dense_accs = [tf.Variable(tf.zeros_like(v)) for v in dense_vars]
    shards = [list(getattr(t, "variables", [t])) for t in (tables + table_accs)]  # one ps: whole
    table_shards, acc_shards = shards[:len(tables)], shards[len(tables):]
    pairs = np.array([i * 27 + j for i in range(27) for j in range(i + 1, 27)], dtype=np.int32)

    def forward(x, row_ids):
        w = dense_vars
        h = tf.nn.relu(tf.nn.relu(x @ w[0] + w[1]) @ w[2] + w[3])
        vectors = tf.stack([h] + [tf.nn.embedding_lookup(t, row_ids[:, f]) for f, t in enumerate(tables)], axis=1)
        dots = tf.gather(tf.reshape(tf.matmul(vectors, vectors, transpose_b=True), (-1, 27 * 27)), pairs, axis=1)
        z = tf.concat([h, dots], axis=1)
        z = tf.nn.relu(tf.nn.relu(z @ w[4] + w[5]) @ w[6] + w[7])
        return tf.squeeze(z @ w[8] + w[9], 1)

    lr, eps = tf.constant(args.lr), tf.constant(1e-10)

    @tf.function
    def step(it):
        def replica_fn(x, row_ids, y):
            flat_shards = [s for group in table_shards for s in group]
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(y, forward(x, row_ids)))
            grads = tape.gradient(loss, flat_shards + dense_vars)
            accs = [a for group in acc_shards for a in group]
            for var, acc, g in zip(flat_shards, accs, grads):  # IndexedSlices: sum duplicates, then Adagrad
                unique, where = tf.unique(g.indices)
                values = tf.math.unsorted_segment_sum(g.values, where, tf.shape(unique)[0])
                tf.raw_ops.ResourceSparseApplyAdagradV2(var=var.handle, accum=acc.handle, lr=lr, epsilon=eps,
                                                        grad=values, indices=unique)
            for var, acc, g in zip(dense_vars, dense_accs, grads[len(flat_shards):]):
                tf.raw_ops.ResourceApplyAdagradV2(var=var.handle, accum=acc.handle, lr=lr, epsilon=eps, grad=g)
            return loss

        return strategy.run(replica_fn, args=next(it))

    n_workers = len(cluster["worker"])
    per_worker = []
    for w in range(n_workers):  # a dataset per shard; worker w keeps the iterator over its own shard
        lo, hi = args.samples * w // n_workers, args.samples * (w + 1) // n_workers
        per_worker.append(iter(coordinator.create_per_worker_dataset(_dataset_fn(
            tf, (dense[lo:hi], ids[lo:hi], labels[lo:hi]), batch))))
    iterator = type(per_worker[0])(tuple(it._values[w] for w, it in enumerate(per_worker)))
    steps = args.samples // batch
    for _ in range(args.warmup):
        coordinator.schedule(step, args=(iterator,))
    coordinator.join()
    start = time.perf_counter()
    results = [coordinator.schedule(step, args=(iterator,)) for _ in range(steps - args.warmup)]
    coordinator.join()
    elapsed = time.perf_counter() - start
    last_loss = float(results[-1].fetch())
    rss = {key: _peak_rss_mb(p.pid) for key, p in procs.items()}

    e_dense, e_ids, e_labels, _ = _arrays(args.eval_samples, args.seed + 1, rows)
    scores = np.concatenate([forward(tf.constant(e_dense[i:i + 8192]), tf.constant(e_ids[i:i + 8192])).numpy()
                             for i in range(0, len(e_labels), 8192)])
    import torch

    print(json.dumps({
        "system": "tensorflow_pss", "samples_per_s": (steps - args.warmup) * batch / elapsed,
        "train_seconds": elapsed, "setup_seconds": start - began,
        "auc": ctr_data.auc(torch.from_numpy(scores), torch.from_numpy(e_labels)),
        "samples": steps * batch, "timed_samples": (steps - args.warmup) * batch, "batch_size": batch,
        "ps": num_ps, "workers": n_workers, "rows": rows, "last_loss": last_loss,
        "worker_peak_rss_mb": max((v for (job, _), v in rss.items() if job == "worker" and v), default=None),
        "ps_peak_rss_mb": max((v for (job, _), v in rss.items() if job == "ps" and v), default=None),
        "chief_peak_rss_mb": _peak_rss_mb(os.getpid()), "tensorflow": tf.__version__}), flush=True)
    for p in procs.values():
        p.kill()
    os._exit(0)  # TF's coordinator threads do not end on their own


if __name__ == "__main__":
    main()
