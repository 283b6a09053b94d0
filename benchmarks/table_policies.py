"""Table policies' memory and accuracy: the admission sketch's size and false-admission rate, a capacity's bound.

One process, no cluster (a ps task runs the same ``LocalTable`` per shard):

1. **Sketch false admission.** ``n`` distinct ids are counted once each in a count-min
   sketch of ``depth x width`` int32 counters (what ``AdmitAfter``/``AdmitWithProbability``
   keep per table shard); then 200k ids never seen are probed. An id with true count ``k``
   is admitted early by ``AdmitAfter(c)`` when its estimate reaches ``c - 1`` before its
   count does: for a first sight that is an estimate >= ``c - 1`` of an unseen id. Printed
   against the count-min bound ``(1 - exp(-n / width)) ** depth`` (for ``c = 2``).
2. **A click stream.** The ids of ``examples/ctr_data.py`` (Criteo schema, power-law
   ids) go through a ``LocalTable`` in training batches, one push (Adagrad) per batch:
   rows and bytes with no policy, with ``AdmitAfter(2)`` (rows made against the exact
   count of ids seen twice or more, so the false admissions are counted exactly, and the
   ids seen twice that got no row: an admitted id's removal from the sketch took counts
   of ids sharing all its counters), and
   with a capacity of half the distinct ids (its bytes at the first step at capacity
   against the most after it: bounded).

Writes ``<out>/table_policies.json``. Not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from _common import machine_info  # noqa: E402
from ctr_data import make_ctr_data  # noqa: E402

from unison._embeddings.optim.row_optimizers import RowAdagrad  # noqa: E402
from unison._embeddings.tables.count_sketch import CountMinSketch  # noqa: E402
from unison._embeddings.tables.local_table import LocalTable  # noqa: E402
from unison.embeddings import AdmitAfter  # noqa: E402


def sketch_rates(width: int, depth: int, pending: int, probes: int = 200_000, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    sketch = CountMinSketch(width, depth)
    counted = torch.randint(-2**63, 2**63 - 1, (pending,), generator=g, dtype=torch.int64)
    for chunk in counted.split(1 << 18):
        sketch.add(chunk, torch.ones_like(chunk))
    unseen = torch.randint(-2**63, 2**63 - 1, (probes,), generator=g, dtype=torch.int64)
    estimate = sketch.estimate(unseen)
    return {"width": width, "depth": depth, "bytes": sketch.max_bytes, "pending_ids": pending,
            "false_admit_after_2": float((estimate >= 1).double().mean()),
            "false_admit_after_3": float((estimate >= 2).double().mean()),
            "bound_after_2": (1 - math.exp(-pending / width)) ** depth}


def stream(samples: int, batch: int, dim: int, seed: int, **policy) -> dict:
    data = make_ctr_data(samples, seed=seed)
    table = LocalTable(dim, seed=seed, **policy)
    optimizer = RowAdagrad(0.01)
    peak, at_capacity, capacity = 0, None, policy.get("capacity")
    start = time.perf_counter()
    for _, sparse, _ in data.batches(batch, drop_last=False):
        ids = sparse.reshape(-1)
        unique, occurrences = torch.unique(ids, return_counts=True)
        table.lookup(unique, occurrences=occurrences)
        table.push(unique, torch.zeros(unique.numel(), dim), optimizer)
        peak = max(peak, table.bytes)
        if at_capacity is None and capacity is not None and table.num_rows >= capacity:
            at_capacity = table.bytes  # the first step at capacity: what follows may only reuse slots
    seconds = time.perf_counter() - start
    admission = table.admission  # its sketch's counters: 4 bytes each, allocated at the first count
    return {"rows": table.num_rows, "bytes": table.bytes, "peak_bytes": peak, "bytes_at_capacity": at_capacity,
            "seconds": seconds, "ids": table.export()["ids"],
            "sketch_bytes": 0 if admission is None else 4 * admission.sketch_width * admission.sketch_depth}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=200_000, help="click-stream samples (26 ids each)")
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    print("count-min sketch: ids counted once each, then unseen ids probed")
    print(f"{'width':>9} {'depth':>5} {'MiB':>5} {'pending ids':>11} {'AdmitAfter(2)':>13} {'bound':>8} "
          f"{'AdmitAfter(3)':>13}")
    rates = []
    for width, depth in ((1 << 18, 4), (1 << 20, 2), (1 << 20, 4)):
        for ratio in (0.125, 0.25, 0.5, 1.0):
            row = sketch_rates(width, depth, int(width * ratio))
            rates.append(row)
            print(f"{width:>9} {depth:>5} {row['bytes'] / 2**20:>5.0f} {row['pending_ids']:>11} "
                  f"{row['false_admit_after_2']:>13.5f} {row['bound_after_2']:>8.5f} "
                  f"{row['false_admit_after_3']:>13.6f}")

    data = make_ctr_data(args.samples, seed=0)
    ids, counts = torch.unique(data.sparse.reshape(-1), return_counts=True)
    exact_admitted = int((counts >= 2).sum())
    plain = stream(args.samples, args.batch, args.dim, 0)
    admitted = stream(args.samples, args.batch, args.dim, 0, admission=AdmitAfter(2))
    early = int((counts[torch.searchsorted(ids, admitted["ids"])] < 2).sum())
    late = exact_admitted - (admitted["rows"] - early)  # seen twice or more, no row: a removal took their count
    half = ids.numel() // 2
    capped = stream(args.samples, args.batch, args.dim, 0, capacity=half)
    print(f"\nclick stream: {args.samples} samples, {ids.numel()} distinct ids, {int((counts == 1).sum())} seen once")
    for name, result in (("no policy", plain), ("AdmitAfter(2)", admitted), (f"capacity={half}", capped)):
        print(f"{name:>16}: {result['rows']:>8} rows, {result['bytes'] / 2**20:7.1f} MiB now, "
              f"{result['peak_bytes'] / 2**20:7.1f} MiB peak (sketch {result['sketch_bytes'] / 2**20:.0f} MiB), "
              f"{result['seconds']:.1f} s")
    print(f"capacity: {capped['bytes_at_capacity'] / 2**20:.1f} MiB at the first step at capacity, "
          f"{capped['peak_bytes'] / 2**20:.1f} MiB at most after it (freed slots reused)")
    print(f"AdmitAfter(2): {exact_admitted} ids were seen twice or more; the table made {admitted['rows']} rows, "
          f"{early} of them for ids seen once (false admission {early / max(1, int((counts == 1).sum())):.5f} of "
          f"the ids seen once), and no row for {late} ids seen twice or more ({late / exact_admitted:.5f})")
    result = {"machine": machine_info(), "sketch": rates, "stream": {
        "samples": args.samples, "distinct_ids": ids.numel(), "seen_once": int((counts == 1).sum()),
        "exact_admitted": exact_admitted, "false_admitted": early, "late": late,
        **{name: {k: v for k, v in r.items() if k != "ids"}
           for name, r in (("no_policy", plain), ("admit_after_2", admitted), ("capacity_half", capped))}}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table_policies.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
