"""TensorFlow's ParameterServerStrategy on the workloads of ``parameter_server.py`` (run by it).

Usage: ``python _tf_parameter_server.py WORKLOAD NUM_PS STEPS WARMUP``; prints one JSON
line. Servers (2 workers, NUM_PS ps) run in their own processes with one intra-op
thread, as unison's do; variables are updated with plain SGD (``assign_sub`` /
``scatter_sub``), so no Keras optimizer is involved.
"""

import json
import multiprocessing
import os
import socket
import sys
import time

BATCH, TABLE_ROWS, TABLE_DIM, IDS = 256, 1_000_000, 64, 8


def _free_port():
    with socket.socket() as s:  # a benchmark helper: TF servers need their ports up front
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(cluster, job, index):
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    # The server's own session config decides its executor's threads (tf.config alone may not reach it).
    config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1, inter_op_parallelism_threads=2)
    server = tf.distribute.Server(tf.train.ClusterSpec(cluster), job_name=job, task_index=index, protocol="grpc",
                                  config=config, start=True)
    server.join()


def main():
    workload, num_ps, steps, warmup = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    cluster = {"worker": [f"127.0.0.1:{_free_port()}" for _ in range(2)],
               "ps": [f"127.0.0.1:{_free_port()}" for _ in range(num_ps)],
               "chief": [f"127.0.0.1:{_free_port()}"]}
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_serve, args=(cluster, job, i), daemon=True)
             for job in ("worker", "ps") for i in range(len(cluster[job]))]
    for p in procs:
        p.start()
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import tensorflow as tf

    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster), task_type="chief", task_id=0, rpc_layer="grpc")
    partitioner = (tf.distribute.experimental.partitioners.FixedShardsPartitioner(num_ps)
                   if workload == "embedding" else None)
    strategy = tf.distribute.ParameterServerStrategy(resolver, variable_partitioner=partitioner)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        if workload == "dense":
            shapes = [(784, 1024), (1024,), (1024, 1024), (1024,), (1024, 10), (10,)]
            variables = [tf.Variable(tf.random.normal(s, stddev=0.03)) for s in shapes]
        else:
            table = tf.Variable(tf.random.normal((TABLE_ROWS, TABLE_DIM), stddev=0.03))
            # (1, 64): one row, so the partitioner leaves it whole
            head_w, head_b = tf.Variable(tf.random.normal((1, TABLE_DIM), stddev=0.1)), tf.Variable(tf.zeros((1,)))

    def dataset_fn():
        if workload == "dense":
            x = tf.random.normal((8 * BATCH, 784), seed=1)
            y = tf.random.uniform((8 * BATCH,), maxval=10, dtype=tf.int64, seed=2)
        else:
            x = tf.random.uniform((8 * BATCH, IDS), maxval=TABLE_ROWS, dtype=tf.int64, seed=1)
            y = tf.random.uniform((8 * BATCH,), seed=2)
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).repeat()

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    @tf.function
    def step(it):
        def replica_fn(x, y):
            if workload == "dense":
                w1, b1, w2, b2, w3, b3 = variables
                with tf.GradientTape() as tape:
                    h = tf.nn.relu(x @ w1 + b1)
                    h = tf.nn.relu(h @ w2 + b2)
                    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, h @ w3 + b3))
                for v, g in zip(variables, tape.gradient(loss, variables)):
                    v.assign_sub(0.01 * g)
            else:
                with tf.GradientTape() as tape:
                    emb = tf.reduce_mean(tf.nn.embedding_lookup(table, x), axis=1)
                    loss = tf.reduce_mean(tf.square(tf.squeeze(emb @ tf.transpose(head_w) + head_b, 1) - y))
                shards = list(table.variables) if hasattr(table, "variables") else [table]  # 1 ps: whole
                grads = tape.gradient(loss, shards + [head_w, head_b])
                for shard, g in zip(shards, grads[:-2]):  # IndexedSlices: only the rows looked up
                    shard.scatter_sub(tf.IndexedSlices(0.01 * g.values, g.indices))
                g_w, g_b = grads[-2:]
                head_w.assign_sub(0.01 * g_w)
                head_b.assign_sub(0.01 * g_b)
            return loss

        x, y = next(it)
        return strategy.run(replica_fn, args=(x, y))

    for _ in range(warmup):
        coordinator.schedule(step, args=(iterator,))
    coordinator.join()
    start = time.perf_counter()
    results = [coordinator.schedule(step, args=(iterator,)) for _ in range(steps)]
    coordinator.join()
    elapsed = time.perf_counter() - start
    last = float(results[-1].fetch())
    print(json.dumps({"samples_per_s": steps * BATCH / elapsed, "steps": steps, "seconds": elapsed, "last_loss": last,
                      "tensorflow": tf.__version__}), flush=True)
    for p in procs:
        p.kill()
    os._exit(0)  # TF's coordinator threads do not end on their own


if __name__ == "__main__":
    main()
