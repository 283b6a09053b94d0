"""The disk tier's costs: a table several times its memory budget trains; RSS growth against the budget
(this process's and its disk stores' writer processes');
samples/s at a ~90% and ~50% hot-set hit rate against the same table all in memory; disk bytes per row.

    python benchmarks/disk_tier.py --rows 1000000 --dim 64 --budget-fraction 0.25 --steps 40 --batch 8192

One process, one device (the ps task's path is the same table code), with a ps task's memory setting
(``release_large_buffers``: glibc's mmap threshold fixed at 1 MB, so freed batch buffers go back to
the system as they do on a ps task; ``--plain-malloc`` leaves glibc's default, as a one-device
trainer has it). Each run is paired: the in-memory table and the tiered one train on the same
batches in the same run. The hit rate is the share of a batch's ids drawn from a hot set; the rest
are drawn uniformly from every row. The hot set is half the rows the budget holds in memory once the
table is filled (the cold rows' index takes its share of the budget, so at 4x the budget that is far
fewer than the budget divided by a row's size; ``--hot-set N`` sets it, ``--hot-set estimate`` takes
the old ``budget / (row + counters + index entry) / 2``); the timed steps start after the hot set
was trained once and ten steps more (the cache's steady state). ``--rounds`` rounds of ``--steps``
steps each, on fresh batches, alternate which table trains first (a shared machine's drift falls on
both), and the ratio is the median of the rounds'. ``rows_in_memory_share`` is the share of each
step's distinct ids found in memory (not read back from disk). Writes ``benchmarks/out/disk_tier.json``;
results in ``benchmarks/RESULTS.md`` (indicative: a shared 2-core machine).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch

from unison import DynamicEmbedding
from unison.embeddings import DiskStorage


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _rss_parts_mb() -> dict[str, float]:
    """Resident memory by kind (Linux): anonymous (heap, tensors) and file-backed (LMDB's mapped file)."""
    parts = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssFile:", "RssShmem:")):
                name, kb = line.split()[:2]
                parts[name.rstrip(":")] = int(kb) / 1024
    return parts


def _children_rss_mb() -> float:
    """Resident memory of this process's children (Linux): the disk stores' writer processes, which a ps
    task's memory includes."""
    total = 0.0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                pids = f.read().split()
        except OSError:
            continue
        for pid in pids:
            try:
                with open(f"/proc/{pid}/statm") as f:
                    total += int(f.read().split()[1]) * resource.getpagesize() / 2**20
            except OSError:
                continue
    return total


def _hot_set(choice: str, hot_rows: int, budget_rows: int) -> int:
    if choice == "fit":
        return hot_rows // 2
    if choice == "estimate":
        return budget_rows // 2
    return int(choice)


def _batches(rows: int, hot: int, hit: float, steps: int, batch: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        from_hot = torch.rand(batch, generator=g) < hit
        ids = torch.where(from_hot, torch.randint(0, hot, (batch,), generator=g),
                          torch.randint(0, rows, (batch,), generator=g))
        out.append(ids)
    return out


def _fill(emb: DynamicEmbedding, opt: torch.optim.Optimizer, rows: int, chunk: int = 8192) -> None:
    """Makes every row (and its Adagrad state) by training on each id once."""
    for start in range(0, rows, chunk):
        emb(torch.arange(start, min(rows, start + chunk))).sum().backward()
        opt.step()
        opt.zero_grad()


def _warm(emb: DynamicEmbedding, opt: torch.optim.Optimizer, hot: int, batches: list[torch.Tensor]) -> None:
    """Brings the hot set into memory (each hot id trained once, in batch-sized chunks), then trains on
    ``batches``: the timed steps start from the cache's steady state, not from the fill's last rows."""
    chunk = batches[0].numel()
    _train(emb, opt, [torch.arange(start, min(hot, start + chunk)) for start in range(0, hot, chunk)])
    _train(emb, opt, batches)


def _train(emb: DynamicEmbedding, opt: torch.optim.Optimizer, batches: list[torch.Tensor]) -> tuple[float, float]:
    """Samples per second of wall time, and per second of this process's CPU time (all its threads: less
    sensitive to a shared machine's load than wall time)."""
    start, cpu = time.perf_counter(), time.process_time()
    for ids in batches:
        emb(ids).pow(2).sum().mul(1e-3).backward()
        opt.step()
        opt.zero_grad()
    samples = sum(b.numel() for b in batches)
    return samples / (time.perf_counter() - start), samples / (time.process_time() - cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--budget-fraction", type=float, default=0.25, help="budget / bytes of every row in memory")
    parser.add_argument("--steps", type=int, default=60, help="timed steps per round and variant")
    parser.add_argument("--rounds", type=int, default=3,
                        help="timed rounds (fresh batches each, the variants' order alternating); the ratio is the "
                             "median of the rounds' ratios")
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--cache", choices=("lru", "lfu"), default="lru", help="DiskStorage's cache policy")
    parser.add_argument("--hot-set", default="fit",
                        help="ids in the hot set: 'fit' (half the hot rows after the fill), 'estimate' (half the "
                             "budget over a row's estimated bytes) or a number")
    parser.add_argument("--plain-malloc", action="store_true",
                        help="glibc's default malloc (a one-device trainer) instead of a ps task's setting")
    args = parser.parse_args()
    if not args.plain_malloc:
        from unison._ps.task.malloc_settings import release_large_buffers

        release_large_buffers()
    torch.set_num_threads(1)
    row_bytes = 4 * 2 * args.dim + 25 + 32  # a row, its Adagrad sum, counters and index entry
    budget = int(args.rows * row_bytes * args.budget_fraction)
    budget_rows = int(budget / row_bytes)
    results: dict = {"rows": args.rows, "dim": args.dim, "budget_bytes": budget, "steps": args.steps,
                     "rounds": args.rounds, "batch": args.batch, "cache": args.cache,
                     "malloc": "glibc default" if args.plain_malloc else "ps task's"}
    warnings.simplefilter("ignore", RuntimeWarning)

    # torch's and autograd's first training step costs ~85 MB (measured with an in-memory table of 2,000 rows):
    # take it before the baseline, so the growth is the tier's own
    warm = DynamicEmbedding(args.dim)
    _fill(warm, torch.optim.Adagrad(warm.parameters(), lr=0.05), 16)
    del warm
    rss_before, parts_before, children_before = _rss_mb(), _rss_parts_mb(), _children_rss_mb()
    with tempfile.TemporaryDirectory() as path:
        tiered = DynamicEmbedding(args.dim, storage=DiskStorage(path, memory_budget_bytes=budget, cache=args.cache))
        opt_t = torch.optim.Adagrad(tiered.parameters(), lr=0.05)
        _fill(tiered, opt_t, args.rows)
        if hasattr(tiered.table._cold.store, "flush"):
            tiered.table._cold.store.flush()  # the spills in flight are written: their memory counts
        writer_rss = _children_rss_mb() - children_before  # the store's writer process (LMDB's page copies)
        rss_tiered = _rss_mb() - rss_before + writer_rss
        results["rss_growth_by_kind_mb"] = {k: v - parts_before.get(k, 0.0) for k, v in _rss_parts_mb().items()}
        results["writer_process_rss_mb"] = writer_rss
        results["hot_table_bytes"] = tiered.table._hot.bytes  # slots up to the high-water mark, not the rows now
        results["cold_index_bytes"] = tiered.table._cold.nbytes
        results["tiered_rss_growth_mb"] = rss_tiered
        results["rss_growth_over_budget"] = rss_tiered * 2**20 / budget
        results["hot_rows"] = hot_rows_filled = tiered.table.hot_rows
        results["disk_bytes_per_row"] = tiered.table.disk_bytes / max(1, tiered.num_rows - tiered.table.hot_rows)
        memory = DynamicEmbedding(args.dim)
        opt_m = torch.optim.Adagrad(memory.parameters(), lr=0.05)
        _fill(memory, opt_m, args.rows)
        results["in_memory_table_bytes"] = memory.table.bytes
        for hit in (0.9, 0.5):
            hot = max(1, _hot_set(args.hot_set, hot_rows_filled, budget_rows))
            warm = _batches(args.rows, hot, hit, 10, args.batch, seed=int(hit * 10))
            _warm(tiered, opt_t, hot, warm)  # the hot set comes in, the cache settles
            _warm(memory, opt_m, hot, warm)
            read_before = getattr(tiered.table, "rows_read_back", None)  # None: a tree from before the counter
            rounds, distinct = [], 0
            for round_ in range(args.rounds):  # fresh batches each round; the order alternates
                batches = _batches(args.rows, hot, hit, args.steps, args.batch, seed=int(hit * 10) + 100 * (round_ + 1))
                if round_ % 2:
                    theirs, ours = _train(memory, opt_m, batches), _train(tiered, opt_t, batches)
                else:
                    ours, theirs = _train(tiered, opt_t, batches), _train(memory, opt_m, batches)
                rounds.append((ours, theirs))
                distinct += sum(torch.unique(b).numel() for b in batches)
            ratios = [ours[0] / theirs[0] for ours, theirs in rounds]
            results[f"hit_{hit}"] = {"hot_set": hot,
                                     "tiered_samples_per_s": statistics.median(ours[0] for ours, _ in rounds),
                                     "in_memory_samples_per_s": statistics.median(theirs[0] for _, theirs in rounds),
                                     "ratio": statistics.median(ratios), "ratio_per_round": ratios,
                                     "ratio_per_cpu_second": statistics.median(o[1] / t[1] for o, t in rounds),
                                     "rows_in_memory_share": None if read_before is None else
                                     1 - (tiered.table.rows_read_back - read_before) / distinct}
        # LMDB's file pages that reads and writes touched are mapped into the process: resident, counted in
        # RSS as file-backed (the kernel's page cache, dropped under memory pressure), growing with the rows read
        results["rss_file_growth_after_training_mb"] = _rss_parts_mb()["RssFile"] - parts_before.get("RssFile", 0.0)
        tiered.table.close()
    for key, value in results.items():
        print(f"{key}: {value}")
    out = Path(__file__).parent / "out"
    os.makedirs(out, exist_ok=True)
    (out / "disk_tier.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
