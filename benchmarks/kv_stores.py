"""Which embedded key-value store holds a disk tier's cold rows: batched put/get/delete of rows keyed by int64 id.

The disk tier (``unison.embeddings.DiskStorage``) writes the rows it spills in batches and
reads the rows a lookup misses in batches; this measures exactly that access pattern for
the well-kept embedded stores on the package registry (RocksDB through ``rocksdict``, LMDB
through ``lmdb``, LevelDB through ``plyvel``), each installed with pip, none written here.

    python benchmarks/kv_stores.py --rows 100000 --dim 64 --batch 4096

Prints one line per store (seconds per phase, rows/s, disk bytes per row) and writes
``benchmarks/out/kv_stores.json``. Results: ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np


def _keys(ids: np.ndarray) -> list[bytes]:
    raw = ids.astype(">i8").tobytes()
    return [raw[i:i + 8] for i in range(0, len(raw), 8)]


def _values(block: np.ndarray) -> list[bytes]:
    raw, width = block.tobytes(), block.shape[1] * block.itemsize
    return [raw[i:i + width] for i in range(0, len(raw), width)]


def _disk_bytes(path: str) -> int:
    # allocated blocks, not sizes: LMDB's file is as large as its map, sparse
    return sum(f.stat().st_blocks * 512 for f in Path(path).rglob("*") if f.is_file())


class _Rocks:
    name = "rocksdict (RocksDB)"

    def __init__(self, path: str) -> None:
        import rocksdict

        options = rocksdict.Options(raw_mode=True)
        options.create_if_missing(True)
        self._mod, self.db = rocksdict, rocksdict.Rdict(path, options)

    def put(self, keys: list[bytes], values: list[bytes]) -> None:
        batch = self._mod.WriteBatch(raw_mode=True)
        for k, v in zip(keys, values):
            batch.put(k, v)
        self.db.write(batch)

    def get(self, keys: list[bytes]) -> list[Any]:
        return self.db[keys]

    def delete(self, keys: list[bytes]) -> None:
        batch = self._mod.WriteBatch(raw_mode=True)
        for k in keys:
            batch.delete(k)
        self.db.write(batch)

    def close(self) -> None:
        self.db.flush()
        self.db.close()


class _Lmdb:
    name = "lmdb (LMDB)"

    def __init__(self, path: str) -> None:
        import lmdb

        self.env = lmdb.open(path, map_size=1 << 36, sync=False, metasync=False, writemap=True)

    def put(self, keys: list[bytes], values: list[bytes]) -> None:
        with self.env.begin(write=True) as txn:
            txn.cursor().putmulti(zip(keys, values))

    def get(self, keys: list[bytes]) -> list[Any]:
        with self.env.begin(buffers=False) as txn:
            return [v for _, v in txn.cursor().getmulti(keys)]

    def delete(self, keys: list[bytes]) -> None:
        with self.env.begin(write=True) as txn:
            for k in keys:
                txn.delete(k)

    def close(self) -> None:
        self.env.sync(True)
        self.env.close()


class _Level:
    name = "plyvel (LevelDB)"

    def __init__(self, path: str) -> None:
        import plyvel

        self.db = plyvel.DB(path, create_if_missing=True)

    def put(self, keys: list[bytes], values: list[bytes]) -> None:
        with self.db.write_batch() as batch:
            for k, v in zip(keys, values):
                batch.put(k, v)

    def get(self, keys: list[bytes]) -> list[Any]:
        get = self.db.get
        return [get(k) for k in keys]

    def delete(self, keys: list[bytes]) -> None:
        with self.db.write_batch() as batch:
            for k in keys:
                batch.delete(k)

    def close(self) -> None:
        self.db.close()


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(store_cls: type, rows: int, dim: int, batch: int, seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(-2**62, 2**62, size=rows, dtype=np.int64)
    values = rng.standard_normal((rows, 2 * dim), dtype=np.float32)  # a row and its Adagrad sum
    path = tempfile.mkdtemp(prefix="kv_")
    try:
        store = store_cls(path)
        batches = [(_keys(ids[i:i + batch]), _values(values[i:i + batch])) for i in range(0, rows, batch)]
        put = _timed(lambda: [store.put(k, v) for k, v in batches])
        order = rng.permutation(rows)
        get_batches = [_keys(ids[order[i:i + batch]]) for i in range(0, rows, batch)]
        got: list[Any] = []
        get = _timed(lambda: [got.extend(store.get(k)) for k in get_batches])
        back = np.frombuffer(b"".join(got), dtype=np.float32).reshape(rows, 2 * dim)
        if not np.array_equal(back, values[order]):
            raise AssertionError(f"{store.name}: rows read back differ")
        # a training step's pattern: read a batch of cold rows, write the same number back
        hot = [(_keys(ids[order[i:i + batch]]), _values(values[order[i:i + batch]])) for i in range(0, rows, batch)]
        overwrite = _timed(lambda: [store.put(k, v) for k, v in hot])
        delete = _timed(lambda: [store.delete(k) for k, _ in batches[: len(batches) // 2]])
        store.close()
        size = _disk_bytes(path)
        return {"store": store.name, "rows": rows, "value_bytes": 8 * dim, "batch": batch,
                "put_rows_per_s": rows / put, "get_rows_per_s": rows / get, "overwrite_rows_per_s": rows / overwrite,
                "delete_rows_per_s": (len(batches) // 2) * batch / delete,
                "disk_bytes_per_row": size / (rows - (len(batches) // 2) * batch)}
    finally:
        shutil.rmtree(path, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    results = []
    for store_cls in (_Rocks, _Lmdb, _Level):
        runs = [measure(store_cls, args.rows, args.dim, args.batch, seed) for seed in range(args.repeats)]
        best = {k: (max(r[k] for r in runs) if k.endswith("per_s") else runs[0][k]) for k in runs[0]}
        results.append(best)
        print(f"{best['store']:22s} put {best['put_rows_per_s']:>10,.0f} rows/s  get {best['get_rows_per_s']:>10,.0f}"
              f"  overwrite {best['overwrite_rows_per_s']:>10,.0f}  delete {best['delete_rows_per_s']:>10,.0f}"
              f"  disk {best['disk_bytes_per_row']:.0f} B/row ({best['value_bytes']} B of values)")
    out = Path(__file__).parent / "out"
    os.makedirs(out, exist_ok=True)
    (out / "kv_stores.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
