"""Delta checkpoints and serving exports of a large table: bytes and seconds of a delta against a full save.

One process (a ps task runs the same ``LocalTable`` per shard and the chief gathers the
parts, so a shard's cost is this one's over its rows). A table of ``--rows`` rows of
``--dim`` float32 values with Adagrad state beside each (default 2**22 x 64: 1 GiB of rows
and 1 GiB of state, 2 GiB in all) is filled from an export, saved full (a save point:
``export_delta(full=True)`` and an atomic ``torch.save`` with fsync, as ``save_checkpoint``
writes it); then ``--changed`` (default 1%) of its rows take one Adagrad step and a delta
is saved the same way. Printed and written to ``<out>/delta_checkpoint.json``: bytes and
seconds of each (the goal: a delta of 1% under 5% of the full save's time), and the
serving side: a full serving export, a delta export after another 1% changed,
``ServingEmbedding.load`` of the full one and ``apply_delta`` of the delta.

Run small first: ``python benchmarks/delta_checkpoint.py --rows 100000``. Not a test: it
asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_info  # noqa: E402

from unison._checkpoint.files import atomic_save  # noqa: E402
from unison._embeddings.optim.row_optimizers import RowAdagrad  # noqa: E402
from unison._embeddings.serving.files import write_export  # noqa: E402
from unison._embeddings.serving.serving_embedding import ServingEmbedding  # noqa: E402
from unison._embeddings.tables.initializers import normal  # noqa: E402
from unison._embeddings.tables.local_table import LocalTable  # noqa: E402


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def _timed(fn):
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def _change(table: LocalTable, rows: int, fraction: float, seed: int) -> int:
    """One Adagrad step on ``fraction`` of the rows (ids 0..rows-1), in batches of 65536."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(rows, generator=g)[:max(1, int(rows * fraction))]
    optimizer = RowAdagrad(0.05, initial_accumulator_value=0.1)
    for part in ids.split(65536):
        table.push(part, torch.randn(part.numel(), table.embedding_dim, generator=g), optimizer)
    return ids.numel()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2**22, help="rows of the table (default 2**22: 2 GiB at dim 64)")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--changed", type=float, default=0.01, help="fraction of rows changed before a delta")
    parser.add_argument("--dir", type=Path, default=None, help="where to write the files (default: a temporary dir)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    if args.rows < 1 or args.dim < 1 or not 0 < args.changed <= 1:
        parser.error(f"--rows and --dim must be >= 1 and --changed in (0, 1], got {args.rows}, {args.dim}, "
                     f"{args.changed}")
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(dir=args.dir))
    try:
        g = torch.Generator().manual_seed(0)
        export = {"ids": torch.arange(args.rows), "rows": torch.randn(args.rows, args.dim, generator=g),
                  "state": {"sum": torch.full((args.rows, args.dim), 0.1)},
                  "counts": torch.ones(args.rows, dtype=torch.int64),
                  "last_seen": torch.zeros(args.rows, dtype=torch.int64),
                  "meta": {"embedding_dim": args.dim, "dtype": "torch.float32", "seed": 0, "step": 0,
                           "initializer": normal(0.0, 1.0).config(), "state_init": {"sum": 0.1}}}
        start = time.perf_counter()
        table = LocalTable.from_export(export)
        build_s = time.perf_counter() - start
        del export
        table_bytes = table.bytes

        _, full_s = _timed(lambda: atomic_save(table.export_delta(full=True), work / "full.pt"))
        full_bytes = _size(work / "full.pt")
        changed = _change(table, args.rows, args.changed, seed=1)
        _, delta_s = _timed(lambda: atomic_save(table.export_delta(), work / "delta.pt"))
        delta_bytes = _size(work / "delta.pt")

        _, export_s = _timed(lambda: write_export(work / "serve-0", table.serving_export(False), None))
        export_bytes = _size(work / "serve-0")
        _change(table, args.rows, args.changed, seed=2)
        _, export_delta_s = _timed(lambda: write_export(work / "serve-1", table.serving_export(True), None))
        export_delta_bytes = _size(work / "serve-1")
        served, load_s = _timed(lambda: ServingEmbedding.load(work / "serve-0"))
        _, apply_s = _timed(lambda: served.apply_delta(work / "serve-1"))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    result = {
        "machine": machine_info(), "rows": args.rows, "dim": args.dim, "table_bytes_in_memory": table_bytes,
        "changed_rows": changed, "build_s": build_s,
        "checkpoint": {"full_bytes": full_bytes, "full_s": full_s, "delta_bytes": delta_bytes, "delta_s": delta_s,
                       "delta_over_full_bytes": delta_bytes / full_bytes, "delta_over_full_s": delta_s / full_s},
        "serving": {"full_export_bytes": export_bytes, "full_export_s": export_s,
                    "delta_export_bytes": export_delta_bytes, "delta_export_s": export_delta_s,
                    "load_s": load_s, "apply_delta_s": apply_s},
    }
    c, s = result["checkpoint"], result["serving"]
    print(f"table: {args.rows} rows x {args.dim} + Adagrad state = {table_bytes / 2**20:.1f} MiB in memory; "
          f"{changed} rows changed ({args.changed:.1%})")
    print(f"checkpoint full : {c['full_bytes'] / 2**20:9.2f} MiB in {c['full_s']:.3f} s")
    print(f"checkpoint delta: {c['delta_bytes'] / 2**20:9.2f} MiB in {c['delta_s']:.3f} s "
          f"({c['delta_over_full_bytes']:.2%} of the bytes, {c['delta_over_full_s']:.2%} of the time)")
    print(f"serving export full : {s['full_export_bytes'] / 2**20:9.2f} MiB in {s['full_export_s']:.3f} s; "
          f"load {s['load_s']:.3f} s")
    print(f"serving export delta: {s['delta_export_bytes'] / 2**20:9.2f} MiB in {s['delta_export_s']:.3f} s; "
          f"apply_delta {s['apply_delta_s']:.3f} s")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "delta_checkpoint.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
