"""Online training with live serving: the update-to-served lag, and training samples/s with serving on vs off.

Runs ``examples/online_ctr.py`` under ``unison launch --workers 2 --ps 1`` (the hybrid
strategy on the drifting click stream), ``--rounds`` times with serving on (worker 0
writes a serving snapshot every ``--export-every`` s and a serving process polls every
``--poll-every`` s, scoring the stream's latest samples after each poll that applied one)
and as many times with ``--no-serving``, alternating and with the order swapped every
round, each for ``--seconds`` of training. Reported (and written to
``<out>/online_serving.json`` with every sample and the machine):

- training samples/s with serving on and off in each round and their paired ratio
  (on / off, same round; goal >= 0.9);
- the lag of each served snapshot after the server's start-up: from the export's start
  to the server answering from it (a row updated just before the export), and the worst
  case, from the previous export's start (a row updated just after that one read it);
  median and max, in seconds and in polling intervals (goal: the worst case under two
  export intervals, i.e. an update is served before the export after next would begin);
- the seconds the chief spent writing each snapshot (training waits for it).

Default: 3 rounds of 15 s each way, about 2.5 minutes. Not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import describe, machine_info  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "online_ctr.py"


def _run(args: argparse.Namespace, serving: bool, work: Path, tag: str) -> dict:
    out = work / f"{tag}.json"
    command = [sys.executable, "-m", "unison.launch", "--workers", "2", "--ps", "1", str(EXAMPLE),
               "--seconds", str(args.seconds), "--export-every", str(args.export_every),
               "--poll-every", str(args.poll_every), "--eval-samples", str(args.eval_samples),
               "--json", str(out), *([] if serving else ["--no-serving"])]
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.seconds + 240)
    if done.returncode != 0:
        raise SystemExit(f"{tag}: the example failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n"
                         f"{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=15.0, help="training seconds of each run")
    parser.add_argument("--export-every", type=float, default=2.0, help="seconds between two serving snapshots")
    parser.add_argument("--poll-every", type=float, default=0.5, help="seconds between the server's polls")
    parser.add_argument("--eval-samples", type=int, default=4096, help="held-out samples scored per poll")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    args = parser.parse_args(argv)
    if args.rounds < 1 or not (args.seconds > 0 and args.export_every > 0 and args.poll_every > 0):
        parser.error(f"--rounds must be >= 1 and --seconds, --export-every, --poll-every > 0, got {args.rounds}, "
                     f"{args.seconds}, {args.export_every}, {args.poll_every}")
    rounds = []
    with tempfile.TemporaryDirectory() as work:
        for r in range(args.rounds):
            order = (True, False) if r % 2 == 0 else (False, True)
            runs = {serving: _run(args, serving, Path(work), f"round{r}-{'on' if serving else 'off'}")
                    for serving in order}
            on, off = runs[True], runs[False]
            rounds.append({"order": ["on" if s else "off" for s in order], "on": on, "off": off,
                           "ratio": on["samples_per_s"] / off["samples_per_s"]})
            print(f"round {r + 1}/{args.rounds} ({' then '.join(rounds[-1]['order'])}): serving on "
                  f"{on['samples_per_s']:,.0f} samples/s, off {off['samples_per_s']:,.0f} samples/s, "
                  f"ratio {rounds[-1]['ratio']:.3f}; {len(on['snapshots'])} snapshots served", flush=True)

    served = [s for rnd in rounds for s in rnd["on"]["snapshots"] if not s["startup"]]
    lags = [s["lag"] for s in served]
    worst = [s["worst_lag"] for s in served if s["worst_lag"] is not None]
    export_s = [x for rnd in rounds for x in rnd["on"]["export_seconds"]]
    ratios = [rnd["ratio"] for rnd in rounds]
    summary = {
        "samples_per_s_on": describe([rnd["on"]["samples_per_s"] for rnd in rounds]),
        "samples_per_s_off": describe([rnd["off"]["samples_per_s"] for rnd in rounds]),
        "ratio_on_over_off": describe(ratios),
        "lag_s": describe(lags) if lags else None,
        "worst_lag_s": describe(worst) if worst else None,
        "export_s": describe(export_s) if export_s else None,
        "worst_lag_over_export_interval": max(worst) / args.export_every if worst else None,
        "lag_over_poll_interval": max(lags) / args.poll_every if lags else None,
    }
    result = {"machine": machine_info(), "settings": vars(args) | {"out": str(args.out)}, "rounds": rounds,
              "summary": summary}
    print(f"training samples/s, serving on / off: paired ratio median {statistics.median(ratios):.3f} "
          f"(rounds {', '.join(f'{x:.3f}' for x in ratios)}; goal >= 0.9)")
    if lags and worst:
        print(f"lag, export start -> served: median {statistics.median(lags):.2f} s, max {max(lags):.2f} s "
              f"({max(lags) / args.poll_every:.1f} poll intervals of {args.poll_every} s)")
        print(f"worst case, previous export start -> served: median {statistics.median(worst):.2f} s, max "
              f"{max(worst):.2f} s ({max(worst) / args.export_every:.2f} export intervals of {args.export_every} s; "
              f"goal < 2)")
    if export_s:
        print(f"writing a snapshot on the chief: median {statistics.median(export_s):.3f} s, max {max(export_s):.3f} s")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "online_serving.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out / 'online_serving.json'}")


if __name__ == "__main__":
    main()
