"""The ``unison`` command: ``unison launch`` starts a local cluster, ``unison server`` a standard server,
``unison serve-embeddings`` a serving process.

``unison launch --workers 2 [--chief] [--ps M] [--evaluator] train.py --lr 0.1`` runs
``train.py`` once per task on this machine, on free loopback ports, with ``TF_CONFIG``
and a fresh cluster key set for each process. ``python -m unison.launch ...`` is the
same as ``unison launch ...``.

``unison server`` runs the standard server of the task described by ``TF_CONFIG``, for
STANDALONE_CLIENT mode; it serves until a client stops it or it receives SIGTERM/SIGINT.

``unison serve-embeddings PATH`` follows the serving snapshots a training job's
``ServingExporter`` writes under ``PATH`` and answers lookups of their tables over HTTP
(``GET /status``, ``POST /lookup``) until SIGTERM/SIGINT. It imports the serving code only
when run, and that code imports no training code.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Sequence

from unison._coordinator.channel import HANDSHAKE_SECONDS, generate_authkey
from unison._launch.core_binding import plan_cores
from unison._launch.local_run import run_local_cluster
from unison._launch.multinode_flags import add_multinode_arguments, is_multinode, launch_nodes
from unison._launch.procs import plan_tasks
from unison.errors import UnisonError

__all__ = ["main", "launch_main", "build_parser"]


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a non-negative integer")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a non-negative number of seconds")
    return value


def _add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=_count, default=1, metavar="N", help="number of worker tasks (default 1)")
    parser.add_argument("--chief", action="store_true", help="add a chief task")
    parser.add_argument("--ps", type=_count, default=0, metavar="M", help="number of parameter-server tasks")
    parser.add_argument("--evaluator", action="store_true", help="add an evaluator task")
    parser.add_argument(
        "--ps-in-workers", action="store_true",
        help="run no ps processes: each worker serves its share of the --ps M tasks in its own process (one host; "
             "less CPU per step, but a lost worker loses its rows, so not with --max-restarts)",
    )
    parser.add_argument(
        "--bind-cores", action="store_true",
        help="run each task of this host on CPUs of its own (this launcher's CPUs split in task order, by whole "
             "physical cores; what a task starts, a data loader's workers too, shares them): faster where a task's "
             "threads hand work to each other, as --ps-in-workers does; not for two jobs on one machine (both would "
             "take the same CPUs)",
    )
    parser.add_argument(
        "--max-restarts", type=_count, default=0, metavar="K",
        help="restart the whole cluster up to K times after a failure",
    )
    parser.add_argument(
        "--grace-period", type=_seconds, default=5.0, metavar="S",
        help="seconds between SIGTERM and SIGKILL, and that a job with a chief gives its ps tasks to exit "
             "after the chief (default 5)",
    )
    add_multinode_arguments(parser)
    parser.add_argument("-m", "--module", action="store_true", help="run SCRIPT as a module (python -m SCRIPT)")
    parser.add_argument("script", help="the Python script (or module, with -m) each task runs")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")


def _positive_seconds(text: str) -> float:
    value = _seconds(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def _port(text: str) -> int:
    value = _count(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (0..65535; 0: a free one)")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The parser of the ``unison`` command and its subcommands."""
    parser = argparse.ArgumentParser(prog="unison", description="unison: tf.distribute-style strategies for PyTorch")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    launch = commands.add_parser("launch", help="run a script as every task of a local cluster")
    _add_launch_arguments(launch)
    launch.set_defaults(run=_launch)
    server = commands.add_parser("server", help="run the standard server of the TF_CONFIG task")
    server.add_argument("--bind", metavar="HOST:PORT", help="listen here instead of the task's cluster address")
    server.add_argument(
        "--handshake-timeout",
        type=_positive_seconds,
        default=HANDSHAKE_SECONDS,
        metavar="S",
        help=f"seconds a connecting client has to prove the cluster's key (default {HANDSHAKE_SECONDS:g})",
    )
    server.set_defaults(run=_server)
    serve = commands.add_parser(
        "serve-embeddings", help="answer lookups of a training job's serving snapshots over HTTP"
    )
    serve.add_argument("path", metavar="PATH", help="the directory a ServingExporter writes its snapshots in")
    serve.add_argument(
        "--poll-seconds", type=_positive_seconds, default=1.0, metavar="S",
        help="seconds between two looks for new snapshots (default 1)",
    )
    serve.add_argument("--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=_port, default=0, metavar="P", help="the port (default 0: a free one, printed)")
    serve.set_defaults(run=_serve_embeddings)
    return parser


def _launch(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    command = [sys.executable, "-m", args.script] if args.module else [sys.executable, args.script]
    if args.ps_in_workers:
        _check_ps_in_workers(args, parser)
    if is_multinode(args):
        return launch_nodes(args, parser, command + list(args.script_args))
    if args.workers_per_node is not None or args.node_rank != 0:
        parser.error(
            "--workers-per-node and --node-rank are multi-node flags; pass --nnodes N and --master-addr HOST too"
        )
    try:
        tasks = plan_tasks(args.workers, chief=args.chief, ps=args.ps, evaluator=args.evaluator)
        if args.bind_cores:  # checked here, where the flag can be named in a usage error
            plan_cores([task for task in tasks if not (args.ps_in_workers and task.type == "ps")])
    except ValueError as e:
        parser.error(str(e))
    return run_local_cluster(
        command + list(args.script_args),
        tasks,
        authkey=generate_authkey(),
        max_restarts=args.max_restarts,
        grace_period=args.grace_period,
        ps_in_workers=args.ps_in_workers,
        bind_cores=args.bind_cores,
    )


def _check_ps_in_workers(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """``--ps-in-workers`` needs ps tasks and workers to serve them, on one node, without restarts."""
    if args.ps < 1 or args.workers < 1:
        parser.error(f"--ps-in-workers has the workers serve the ps tasks: it needs --ps M >= 1 and --workers N "
                     f">= 1, got --ps {args.ps} --workers {args.workers}")
    if args.max_restarts:
        parser.error(f"--ps-in-workers keeps the rows in the workers' processes, so a restart would lose them; "
                     f"--max-restarts {args.max_restarts} needs ps tasks of their own: drop one of the two flags")
    if is_multinode(args):
        parser.error("--ps-in-workers is for a one-node launch; with --nnodes run the ps tasks as their own processes")


def _server(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from unison._coordinator.standard_server import run_standard_server

    try:
        server = run_standard_server(bind_address=args.bind, handshake_timeout=args.handshake_timeout)
    except ValueError as e:
        print(f"unison server: error: {e}", file=sys.stderr)
        return 2
    except UnisonError as e:
        print(f"unison server: {e}", file=sys.stderr)
        return 1

    def stop(signum: int, frame: object) -> None:
        server.stop()

    previous = signal.signal(signal.SIGTERM, stop)
    print(f"unison server: serving {server.name} at {server.address}", file=sys.stderr, flush=True)
    try:
        server.join()
    except KeyboardInterrupt:
        server.stop()
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


def _serve_embeddings(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    where = "unison serve-embeddings"
    if not os.path.isdir(args.path):
        what = "does not exist" if not os.path.exists(args.path) else "is not a directory"
        print(f"{where}: error: PATH {args.path!r} {what}; fix: pass the root directory the training job's "
              f"ServingExporter writes (create it first if the job has not started)", file=sys.stderr)
        return 2
    from unison._embeddings.serving.http_server import EmbeddingServer  # here: `unison launch` needs no torch

    try:
        server = EmbeddingServer(args.path, args.poll_seconds, args.host, args.port)
    except OSError as e:
        print(f"{where}: error: cannot listen on {args.host}:{args.port} ({e}); fix: pass a free --port, or "
              f"--port 0 for any free one", file=sys.stderr)
        return 2
    stopped = threading.Event()

    def stop(signum: int, frame: object) -> None:
        stopped.set()

    previous = signal.signal(signal.SIGTERM, stop)
    server.start()
    print(f"{where}: serving {args.path} at {server.url}", file=sys.stderr, flush=True)
    try:
        while not stopped.wait(1.0):  # set by SIGTERM; SIGINT raises KeyboardInterrupt here
            pass
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
        signal.signal(signal.SIGTERM, previous)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``unison`` console script. Returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.run(args, parser))


def launch_main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m unison.launch``: the same as ``unison launch``."""
    parser = argparse.ArgumentParser(
        prog="python -m unison.launch", description="run a script as every task of a local cluster"
    )
    _add_launch_arguments(parser)
    return _launch(parser.parse_args(argv), parser)
