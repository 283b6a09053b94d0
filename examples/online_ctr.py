"""Online training with live serving: a hybrid job trains on an unbounded, drifting click stream while a
separate serving process serves the model it publishes every few seconds.

Run (2 workers, dense layers all-reduced every step, embedding rows on 1 ps task)::

    unison launch --workers 2 --ps 1 examples/online_ctr.py --seconds 60 --export-every 5

Each worker reads its own partition of an endless stream (``click_stream.py``: the
Criteo-schema samples of ``ctr_data.py`` whose item groups take turns being clicked, so
the best model moves). Worker 0 publishes the model with
``unison.embeddings.ServingExporter`` (once before training, then every
``--export-every`` seconds: a serving snapshot holding the table's rows changed since
the last one and the dense layers) and starts the serving process, this script with
``--serve``, which polls the snapshots every ``--poll-every`` seconds with
``unison.embeddings.ServingFollower``, scores held-out samples of the stream's latest
moment with the served model (``ServingEmbedding`` rows and the dense state in a
``DLRM``), and prints, for each poll that applied a snapshot (a line from a run with
``--export-every 0.5 --poll-every 0.2``)::

    [serving] snapshot 27 (delta) at 21,504 samples: served AUC 0.7547 (best possible 0.8474);
    lag 0.46 s from its export, 0.97 s worst case

The lag is from the export's start (a row updated just before it) to the serving process
answering from it; the worst case is from the previous export's start (a row updated just
after that one read it waits for this one). Training goes on meanwhile. It stops after
``--seconds`` or ``--steps`` (whichever comes first; workers agree every 10 steps), writes a
last snapshot, and waits for the serving process to serve it; the serving process prints the
lags' median and max (leaving out the untrained model's snapshots, written before training
starts: their lag is the server's start-up). ``--no-serving`` trains the
same way without exporting or serving (``benchmarks/online_serving.py`` compares the two).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from click_stream import batch_at, drifting_clicks  # noqa: E402
from ctr_data import auc, bayes_auc  # noqa: E402
from dlrm import DLRM, dynamic_table  # noqa: E402

import unison  # noqa: E402

EVAL_SEED = 7  # the held-out samples: another seed of the same drifting stream
STOP_CHECK_EVERY = 10  # steps between two agreements on stopping (one tiny all-reduce)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="train this long (then stop)")
    parser.add_argument("--steps", type=int, default=None, help="or stop after this many steps, if sooner")
    parser.add_argument("--batch-size", type=int, default=256, help="per worker")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--period", type=int, default=200_000, help="samples for the drift to go round once")
    parser.add_argument("--amplitude", type=float, default=1.5, help="the drift's size, in logits")
    parser.add_argument("--export-every", type=float, default=5.0, help="seconds between two serving snapshots")
    parser.add_argument("--full-every", type=int, default=10, help="deltas between two full snapshots")
    parser.add_argument("--poll-every", type=float, default=1.0, help="seconds between the server's polls")
    parser.add_argument("--eval-samples", type=int, default=8192, help="held-out samples the server scores")
    parser.add_argument("--dir", type=Path, default=None,
                        help="the serving directory: snapshots/ (emptied at the start) and the two processes' "
                             "control files (default: a temporary one, removed at the end)")
    parser.add_argument("--no-serving", action="store_true", help="train without exporting or serving")
    parser.add_argument("--json", type=Path, default=None, help="write the result here (the benchmark reads it)")
    parser.add_argument("--serve", type=Path, default=None, help=argparse.SUPPRESS)  # the serving process's role
    args = parser.parse_args(argv)
    for name in ("seconds", "export_every", "poll_every"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    for name in ("batch_size", "period", "eval_samples"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    return args


def _model(args: argparse.Namespace, embeddings: torch.nn.Module) -> DLRM:
    return DLRM(embeddings, embedding_dim=args.dim, bottom=(64, args.dim))


# ---- the serving process -------------------------------------------------------------------------------------


def serve(args: argparse.Namespace) -> None:
    """Follows the snapshots under ``args.serve`` until the trainer's stop file names the last one served."""
    torch.set_num_threads(1)  # a server beside the trainers: one core's worth at most
    root, stop_file, ready = args.serve / "snapshots", args.serve / "trainer.done", args.serve / "serving.ready"
    follower = unison.embeddings.ServingFollower(root)
    parent = os.getppid()
    model: DLRM | None = None
    served: list[dict] = []
    polls = 0
    while True:
        began = time.monotonic()
        stop = json.loads(stop_file.read_text()) if stop_file.exists() else None  # read before polling
        applied = follower.poll()
        polls += 1
        if applied:
            if model is None:
                model = _model(args, follower.embeddings["table"]).eval()
            model.embeddings = follower.embeddings["table"]  # a new chain brings new tables
            assert follower.dense_state is not None
            model.load_state_dict(follower.dense_state)
            records = _report(args, model, applied)
            for record in records:  # the untrained model's lags hold the server's start-up, not serving's
                record["startup"] = not record["position"]
            served.extend(records)
            if not ready.exists():  # the trainer starts once a model is served
                ready.write_text("")
        if stop is not None and follower.number == stop["last"]:
            break
        if os.getppid() != parent:  # the trainer is gone without a stop file
            raise SystemExit("[serving] the training process ended without its last snapshot; stopping")
        time.sleep(max(0.0, args.poll_every - (time.monotonic() - began)))
    lags = [s["lag"] for s in served if not s["startup"]] or [float("nan")]
    worst = [s["worst_lag"] for s in served if not s["startup"] and s["worst_lag"] is not None] or [float("nan")]
    print(f"[serving] served {len(served)} snapshots in {polls} polls; after start-up, lag median "
          f"{statistics.median(lags):.2f} s, max {max(lags):.2f} s; worst case median "
          f"{statistics.median(worst):.2f} s, max {max(worst):.2f} s (export every {args.export_every} s, poll "
          f"every {args.poll_every} s)", flush=True)
    (args.serve / "served.json").write_text(json.dumps({"snapshots": served, "polls": polls}))


def _report(args: argparse.Namespace, model: DLRM, applied: list) -> list[dict]:
    """One record per applied snapshot and one line per poll: the newest is scored on the stream's latest samples."""
    newest = applied[-1]
    position = int(newest.info.get("position", 0))
    test = batch_at(position, args.eval_samples, seed=args.seed + EVAL_SEED, period=args.period,
                    amplitude=args.amplitude)
    with torch.no_grad():
        score = auc(model(test.dense, test.sparse), test.labels)
    best = bayes_auc(test)
    records = [{"number": snapshot.number, "kind": snapshot.kind, "position": snapshot.info.get("position"),
                "lag": snapshot.lag, "worst_lag": snapshot.worst_lag, "export_seconds": snapshot.seconds,
                "auc": score if snapshot is newest else None, "bayes_auc": best if snapshot is newest else None}
               for snapshot in applied]
    also = f"; {len(applied) - 1} earlier in this poll" if len(applied) > 1 else ""
    worst = "" if newest.worst_lag is None else f", {newest.worst_lag:.2f} s worst case"
    print(f"[serving] snapshot {newest.number} ({newest.kind}{also}) at {position:,} samples: served AUC "
          f"{score:.4f} (best possible {best:.4f}); lag {newest.lag:.2f} s from its export{worst}", flush=True)
    return records


# ---- the training job ----------------------------------------------------------------------------------------


def train(args: argparse.Namespace) -> None:
    resolver = unison.TFConfigClusterResolver()
    if resolver.task_type == "ps":
        unison.Server(resolver).join()  # holds rows until the launcher ends the job
        return
    strategy = unison.HybridParameterServerStrategy(resolver)
    rank, workers = strategy.extended.components.cluster.rank, strategy.num_replicas_in_sync
    with strategy.scope():
        torch.manual_seed(args.seed)
        model = _model(args, dynamic_table(args.dim, seed=args.seed))
        optimizer = torch.optim.Adagrad(model.parameters(), lr=args.lr)

    def step(dense: torch.Tensor, sparse: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = F.binary_cross_entropy_with_logits(model(dense, sparse), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.detach()

    global_batch = args.batch_size * workers
    stream = drifting_clicks(args.batch_size, seed=args.seed, start=rank * args.batch_size, stride=global_batch,
                             period=args.period, amplitude=args.amplitude)
    serving = _Serving(args, model) if rank == 0 and not args.no_serving else None
    strategy.join_pushes()  # a barrier: every worker's clock starts once the model is served
    start, steps, loss = time.perf_counter(), 0, float("nan")
    while True:
        _, batch = next(stream)
        loss = float(strategy.run(step, args=(batch.dense, batch.sparse, batch.labels)))
        steps += 1
        if serving is not None:
            serving.after_step(steps, steps * global_batch)
        if steps % STOP_CHECK_EVERY == 0 and _agree_to_stop(strategy, args, steps, time.perf_counter() - start):
            break
        if rank == 0 and steps % 200 == 0:
            print(f"[train] step {steps}: {steps * global_batch:,} samples, loss {loss:.4f}, "
                  f"{steps * global_batch / (time.perf_counter() - start):,.0f} samples/s", flush=True)
    seconds = time.perf_counter() - start
    strategy.join_pushes()  # every worker's rows are on the ps before the last snapshot reads them
    if rank != 0:
        return
    result = {"samples": steps * global_batch, "steps": steps, "seconds": seconds,
              "samples_per_s": steps * global_batch / seconds, "workers": workers, "serving": serving is not None,
              "loss": loss}
    print(f"[train] {steps} steps, {result['samples']:,} samples in {seconds:.1f} s "
          f"({result['samples_per_s']:,.0f} samples/s){'' if serving else ' without serving'}", flush=True)
    if serving is not None:
        result.update(serving.finish(steps, steps * global_batch))
    if args.json is not None:
        args.json.write_text(json.dumps(result))


def _agree_to_stop(strategy: unison.HybridParameterServerStrategy, args: argparse.Namespace, steps: int,
                   seconds: float) -> bool:
    """Whether any worker is done (by time or steps): the workers must run the same number of steps."""
    done = seconds >= args.seconds or (args.steps is not None and steps >= args.steps)
    return bool(strategy.reduce("sum", torch.tensor(float(done))) > 0)


class _Serving:
    """Worker 0's part: the exporter of the training model, and the serving process it starts."""

    def __init__(self, args: argparse.Namespace, model: DLRM) -> None:
        self.args = args
        self.workdir = args.dir if args.dir is not None else Path(tempfile.mkdtemp(prefix="online_ctr-"))
        shutil.rmtree(self.workdir / "snapshots", ignore_errors=True)  # this run's snapshots only
        self.workdir.mkdir(parents=True, exist_ok=True)
        for name in ("trainer.done", "serving.ready"):
            (self.workdir / name).unlink(missing_ok=True)
        self.exporter = unison.embeddings.ServingExporter(self.workdir / "snapshots", {"table": model.embeddings},
                                                          dense=model, every_seconds=args.export_every,
                                                          full_every=args.full_every)
        self.export_seconds: list[float] = []
        self._export({"position": 0, "step": 0})  # the untrained model: the server has one to serve at once
        self.server = subprocess.Popen([sys.executable, __file__, "--serve", str(self.workdir),
                                        *_serving_flags(args)])
        print(f"[train] serving process {self.server.pid} follows {self.workdir / 'snapshots'}", flush=True)
        self._wait_until_served()
        # Training starts now: a snapshot that begins now (a delta of nothing) is the predecessor of the first
        # one with trained rows, so that one's worst-case lag is not the server's start-up.
        self._export({"position": 0, "step": 0})

    def _wait_until_served(self) -> None:
        """Blocks until the serving process serves the first snapshot (its start-up is not part of the lag)."""
        deadline = time.monotonic() + 120
        while not (self.workdir / "serving.ready").exists():
            if self.server.poll() is not None:
                raise SystemExit(f"[train] the serving process failed to start (exit code {self.server.returncode})")
            if time.monotonic() > deadline:
                self.server.kill()
                raise SystemExit("[train] the serving process served nothing within 120 s")
            time.sleep(0.05)

    def _export(self, info: dict) -> Path:
        began = time.perf_counter()
        path = self.exporter.export(info)
        self.export_seconds.append(time.perf_counter() - began)
        return path

    def after_step(self, step: int, position: int) -> None:
        began = time.perf_counter()
        if self.exporter.maybe_export({"position": position, "step": step}) is not None:  # every --export-every s
            self.export_seconds.append(time.perf_counter() - began)

    def finish(self, step: int, position: int) -> dict:
        """The last snapshot, served before the serving process stops; what it measured."""
        last = self._export({"position": position, "step": step})
        (self.workdir / "trainer.done").write_text(json.dumps({"last": int(last.name)}))
        try:
            code = self.server.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.server.kill()
            raise SystemExit("[train] the serving process did not serve the last snapshot within 120 s") from None
        if code != 0:
            raise SystemExit(f"[train] the serving process failed (exit code {code})")
        served = json.loads((self.workdir / "served.json").read_text())
        if self.args.dir is None:
            shutil.rmtree(self.workdir, ignore_errors=True)
        return {"exports": len(self.export_seconds), "export_seconds": self.export_seconds,
                "last_snapshot": int(last.name), **served}


def _serving_flags(args: argparse.Namespace) -> list[str]:
    return ["--seed", str(args.seed), "--dim", str(args.dim), "--period", str(args.period), "--amplitude",
            str(args.amplitude), "--export-every", str(args.export_every), "--poll-every", str(args.poll_every),
            "--eval-samples", str(args.eval_samples)]


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    if args.serve is not None:
        serve(args)
    else:
        train(args)


if __name__ == "__main__":
    main()
