"""Recommendation scale: a DLRM on Criteo-schema synthetic data, unison against TensorFlow and TorchRec.

Every variant trains the model of ``examples/dlrm.py`` (bottom MLP 13-64-16, 26
categorical features of dimension 16, pairwise dot interaction, top MLP 367-64-32-1,
Adagrad lr 0.05) on the same ``--samples`` samples of ``examples/ctr_data.py`` (seed 0)
and reports samples/s over the timed steps and the AUC on ``--eval-samples`` held-out
samples (seed 1):

- ``one_device`` (batch 256) and ``one_device_512`` (batch 512, the hybrid job's global
  batch): ``examples/ctr.py --strategy one_device``, the AUC references;
- ``floor_two_alone``: two one-device processes at once, each on half the samples with
  one thread (what the two cores do for two workers with no communication and no ps);
- ``unison_hybrid``: ``unison launch --workers 2 --ps 2 examples/ctr.py`` (dense layers
  all-reduced, rows on the ps tasks; batch 256 per worker);
- ``unison_hybrid_ps_in_workers``: the same with ``--ps-in-workers`` (no ps processes: each
  worker serves one ps task in its own process and reaches it without a socket);
- ``..._bound``: the floor, ``unison_hybrid_ps_in_workers`` and ``torchrec_cpu`` with each
  process on a CPU of its own (``unison launch --bind-cores``; the floor's two processes and
  TorchRec's two ranks bound the same way), where the machine has a CPU per process;
- ``unison_ps``: ``unison launch --chief --workers 2 --ps 2 examples/ctr.py --strategy ps``
  (asynchronous; batch 256 per step);
- ``tensorflow_pss``: ``_tf_dlrm.py``, TensorFlow's ParameterServerStrategy with the
  same cluster (chief + 2 workers + 2 ps), fixed tables of ``--rows`` rows per feature
  (ids by ``hashed_to_rows``), when TensorFlow imports (``--tf-path``: a ``pip install
  --target`` directory);
- ``torchrec_cpu``: ``_torchrec_dlrm.py``, TorchRec's sharded EmbeddingBagCollection on 2
  gloo ranks (``--torchrec-path``), when it imports and runs;
- the table policies and row optimizers under the hybrid job (issue 43), each against
  ``unison_hybrid`` in the same round: ``hybrid_admit_after_2`` (``--admit-after 2``),
  ``hybrid_capacity_half`` (``--capacity``: half the distinct ids of ``--samples``,
  ``--capacity-rows``), ``hybrid_sparse_adam`` and ``hybrid_ftrl`` (``--optimizer``); their
  rows and table bytes per ps task come from ``table_stats``. Not run unless named in
  ``--variants``.

``--data movielens`` trains every variant on MovieLens-100k instead (``examples/movielens_data.py``:
``--epochs`` passes over its 80,000 training ratings, AUC on the 20,000 held out, each
user's last 20% by time; ``--samples``, ``--eval-samples`` and ``--rows`` do not apply):
one device, the floor, the hybrid and async PS jobs and TorchRec (one table per feature of
exactly its cardinality); TensorFlow's script has no MovieLens path.

unison's tables are dynamic (any int64 id, no ``--rows``); the peers need a fixed size.
Rounds alternate the order of the variants (paired measurements on a noisy machine).
Writes ``<out>/recsys.json`` and ``<out>/recsys.png`` (``recsys_movielens.*`` with
``--data movielens``). Run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from unison._launch.core_binding import plan_cores, started_on

HERE = Path(__file__).resolve().parent
EXAMPLE = HERE.parent / "examples" / "ctr.py"
sys.path.insert(0, str(HERE))
from _common import machine_info  # noqa: E402


def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _run_json(command: list[str], env: dict[str, str] | None = None, timeout: int = 1200,
              json_file: bool = True) -> dict[str, Any]:
    """Runs a variant; its result is the JSON it writes (``--json``) or its last stdout line."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        full = command + (["--json", str(out)] if json_file else [])
        done = subprocess.run(full, capture_output=True, text=True, timeout=timeout, env=env)
        if done.returncode != 0:
            return {"error": (done.stderr or done.stdout)[-2000:], "returncode": done.returncode}
        if json_file:
            return json.loads(out.read_text())
        return json.loads(done.stdout.strip().splitlines()[-1])


def _peer_env(path: str | None) -> dict[str, str]:
    env = dict(os.environ)
    if path:
        env["PYTHONPATH"] = path + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _two_alone(common: list[str], bind: bool = False) -> dict[str, Any]:
    """Two one-device trainings at once, each on its half: samples over the slower one's time
    (``bind``: each on CPUs of its own, as ``unison launch --bind-cores`` binds two tasks)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        cores = plan_cores([0, 1]) if bind else {}
    except ValueError as e:  # fewer than two CPUs: the bound variant has no result, the others go on
        return {"error": str(e)}
    with tempfile.TemporaryDirectory() as tmp:
        outs = [Path(tmp) / f"{i}.json" for i in range(2)]
        procs = []
        for i, out in enumerate(outs):
            with started_on(cores.get(i)):
                procs.append(subprocess.Popen([sys.executable, str(EXAMPLE), "--strategy", "one_device", "--shard",
                                               f"{i}/2", *common, "--json", str(out)], env=env,
                                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        errors = [p.communicate(timeout=1200)[1] for p in procs]
        if any(p.returncode for p in procs):
            return {"error": "\n".join(errors)[-2000:]}
        results = [json.loads(out.read_text()) for out in outs]
    seconds = max(r["seconds"] for r in results)
    samples = sum(r["samples"] for r in results)
    return {"samples": samples, "seconds": seconds, "samples_per_s": samples / seconds,
            "auc": statistics.mean(r["auc"] for r in results)}


def variants(args: argparse.Namespace) -> dict[str, Any]:
    """Each variant's command: a callable that returns its result."""
    py = sys.executable
    if args.data == "movielens":
        common = ["--data", "movielens", "--epochs", str(args.epochs)]
        peer_args = ["--data", "movielens", "--epochs", str(args.epochs), "--batch-size", "256", "--seed", "0"]
    else:
        common = ["--train", str(args.samples), "--test", str(args.eval_samples)]
        peer_args = ["--samples", str(args.samples), "--batch-size", "256", "--rows", str(args.rows),
                     "--eval-samples", str(args.eval_samples), "--seed", "0"]
    commands = {
        "one_device": lambda: _run_json([py, str(EXAMPLE), "--strategy", "one_device", *common]),
        "one_device_512": lambda: _run_json([py, str(EXAMPLE), "--strategy", "one_device", "--batch-size", "512",
                                             *common]),
        "floor_two_alone": lambda: _two_alone(common),
        "floor_two_alone_bound": lambda: _two_alone(common, bind=True),
        "unison_hybrid": lambda: _run_json([py, "-m", "unison.launch", "--workers", "2", "--ps", "2", str(EXAMPLE),
                                            *common]),
        "unison_hybrid_ps_in_workers": lambda: _run_json([py, "-m", "unison.launch", "--workers", "2", "--ps", "2",
                                                          "--ps-in-workers", str(EXAMPLE), *common]),
        "unison_hybrid_ps_in_workers_bound": lambda: _run_json([py, "-m", "unison.launch", "--workers", "2", "--ps",
                                                                "2", "--ps-in-workers", "--bind-cores", str(EXAMPLE),
                                                                *common]),
        "unison_ps": lambda: _run_json([py, "-m", "unison.launch", "--chief", "--workers", "2", "--ps", "2",
                                        str(EXAMPLE), "--strategy", "ps", *common]),
        "tensorflow_pss": lambda: _run_json([py, str(HERE / "_tf_dlrm.py"), *peer_args, "--num-ps", "2"],
                                            env=_peer_env(args.tf_path), json_file=False),
        "torchrec_cpu": lambda: _run_json([py, str(HERE / "_torchrec_dlrm.py"), *peer_args, "--world-size", "2"],
                                          env=_peer_env(args.torchrec_path), json_file=False),
        "torchrec_cpu_bound": lambda: _run_json([py, str(HERE / "_torchrec_dlrm.py"), *peer_args, "--world-size", "2",
                                                 "--bind-cores"], env=_peer_env(args.torchrec_path), json_file=False),
        **{name: (lambda flags=flags: _run_json([py, "-m", "unison.launch", "--workers", "2", "--ps", "2",
                                                  str(EXAMPLE), *common, *flags]))
           for name, flags in _policy_variants(args).items()},
    }
    if args.data == "movielens":
        del commands["tensorflow_pss"]  # _tf_dlrm.py trains on the synthetic data only
    return commands


def _policy_variants(args: argparse.Namespace) -> dict[str, list[str]]:
    """The hybrid job under each table policy or row optimizer (issue 43), by its extra flags."""
    return {"hybrid_admit_after_2": ["--admit-after", "2"],
            "hybrid_capacity_half": ["--capacity", str(args.capacity_rows)],
            "hybrid_sparse_adam": ["--optimizer", "sparse_adam"],
            "hybrid_ftrl": ["--optimizer", "ftrl"]}


POLICY_VARIANTS = ("hybrid_admit_after_2", "hybrid_capacity_half", "hybrid_sparse_adam", "hybrid_ftrl")


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Median samples/s and AUC per variant, and the ratios the issue's goals name, per round and median."""
    names = sorted({name for r in rounds for name in r["results"]})
    table: dict[str, Any] = {}
    for name in names:
        ok = [r["results"][name] for r in rounds if "samples_per_s" in r["results"].get(name, {})]
        if ok:
            table[name] = {"samples_per_s": statistics.median(x["samples_per_s"] for x in ok),
                           "auc": statistics.median(x["auc"] for x in ok), "runs": len(ok)}
        else:
            errors = [r["results"].get(name, {}).get("error", "") for r in rounds]
            table[name] = {"error": next((e for e in errors if e), "no result")}
    ratios: dict[str, Any] = {}
    pairs = [("hybrid", "unison_hybrid", peer) for peer in ("tensorflow_pss", "torchrec_cpu", "floor_two_alone")]
    pairs += [("hybrid_ps_in_workers", "unison_hybrid_ps_in_workers", peer)
              for peer in ("torchrec_cpu", "floor_two_alone", "unison_hybrid")]
    pairs += [("hybrid_ps_in_workers_bound", "unison_hybrid_ps_in_workers_bound", peer)
              for peer in ("torchrec_cpu", "torchrec_cpu_bound", "floor_two_alone", "floor_two_alone_bound",
                           "unison_hybrid_ps_in_workers")]
    for label, ours, peer in pairs:  # round by round: the two ran minutes apart at most
        per_round = [r["results"][ours]["samples_per_s"] / r["results"][peer]["samples_per_s"]
                     for r in rounds if "samples_per_s" in r["results"].get(ours, {})
                     and "samples_per_s" in r["results"].get(peer, {})]
        if per_round:
            ratios[f"{label}_vs_{peer}"] = {"per_round": [round(x, 3) for x in per_round],
                                            "median": round(statistics.median(per_round), 3)}
    for name in POLICY_VARIANTS:  # against the hybrid job without a policy, round by round
        pairs = [(r["results"][name], r["results"]["unison_hybrid"]) for r in rounds
                 if "samples_per_s" in r["results"].get(name, {})
                 and "samples_per_s" in r["results"].get("unison_hybrid", {})]
        if pairs:
            ratios[f"{name}_vs_hybrid"] = {
                "samples_per_s": round(statistics.median(p["samples_per_s"] / b["samples_per_s"] for p, b in pairs), 3),
                "auc_minus": round(statistics.median(p["auc"] - b["auc"] for p, b in pairs), 4),
                "rows": [sum(p.get("rows_per_ps", [])) for p, _ in pairs],
                "rows_without": [sum(b.get("rows_per_ps", [])) for _, b in pairs],
                "table_mb": [round(sum(p.get("table_bytes_per_ps", [])) / 2**20, 1) for p, _ in pairs],
                "table_mb_without": [round(sum(b.get("table_bytes_per_ps", [])) / 2**20, 1) for _, b in pairs]}
    if "auc" in table.get("unison_hybrid", {}) and "auc" in table.get("one_device_512", {}):
        ratios["hybrid_auc_minus_one_device_512"] = round(
            table["unison_hybrid"]["auc"] - table["one_device_512"]["auc"], 4)
    if "auc" in table.get("unison_hybrid", {}) and "auc" in table.get("torchrec_cpu", {}):
        ratios["hybrid_auc_minus_torchrec_cpu"] = round(table["unison_hybrid"]["auc"] - table["torchrec_cpu"]["auc"],
                                                        4)
    if "auc" in table.get("unison_ps", {}) and "auc" in table.get("one_device", {}):
        ratios["ps_auc_minus_one_device"] = round(table["unison_ps"]["auc"] - table["one_device"]["auc"], 4)
    return {"variants": table, "goals": ratios}


def plot(summary: dict[str, Any], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(name, v) for name, v in summary["variants"].items() if "samples_per_s" in v]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    names = [name for name, _ in rows]
    axes[0].barh(names, [v["samples_per_s"] for _, v in rows], color="tab:blue")
    axes[0].set_xlabel("samples/s (median over rounds)")
    axes[1].barh(names, [v["auc"] for _, v in rows], color="tab:green")
    axes[1].set_xlim(0.5, 0.85)
    axes[1].set_xlabel("held-out AUC after the same samples")
    fig.suptitle(f"DLRM on {title} (2 workers, 2 ps where distributed)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", choices=("synthetic", "movielens"), default="synthetic",
                        help="Criteo-schema synthetic clicks, or MovieLens-100k's ratings")
    parser.add_argument("--epochs", type=int, default=1, help="movielens: passes over the training split")
    parser.add_argument("--samples", type=int, default=200_000)
    parser.add_argument("--eval-samples", type=int, default=50_000)
    parser.add_argument("--rows", type=int, default=200_000, help="rows per feature of the peers' fixed tables")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--capacity-rows", type=int, default=176_000,
                        help="hybrid_capacity_half's capacity: half the distinct ids of the default 200k samples")
    parser.add_argument("--variants", default=None, help="comma-separated subset")
    parser.add_argument("--tf-path", default=None)
    parser.add_argument("--torchrec-path", default=None)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    commands = variants(args)
    chosen = (args.variants.split(",") if args.variants
              else [name for name in commands if name not in POLICY_VARIANTS])  # those only by name
    unknown = [name for name in chosen if name not in commands]
    if unknown:
        parser.error(f"--variants: unknown {unknown}; choose from {sorted(commands)}")
    rounds = []
    for index in range(args.rounds):
        order = chosen if index % 2 == 0 else list(reversed(chosen))
        results = {}
        for name in order:
            before = _loadavg()
            results[name] = {**commands[name](), "loadavg_before": before}
            shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in results[name].items()
                     if k in ("samples_per_s", "auc", "error", "loadavg_before")}
            print(f"round {index + 1}/{args.rounds} {name}: {shown}", flush=True)
        rounds.append({"order": order, "results": results})
    summary = summarize(rounds)
    result = {"machine": machine_info(), "data": args.data, "rounds": rounds, "summary": summary,
              **({"epochs": args.epochs} if args.data == "movielens" else
                 {"samples": args.samples, "eval_samples": args.eval_samples, "peer_rows": args.rows})}
    args.out.mkdir(parents=True, exist_ok=True)
    name = "recsys_movielens" if args.data == "movielens" else "recsys"
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=2, default=str))
    plot(summary, args.out / f"{name}.png",
         "MovieLens-100k" if args.data == "movielens" else "Criteo-schema synthetic data")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
