"""The multi-node flags of ``unison launch`` (``--nnodes``, ``--node-rank``, ...) and their check.

``unison launch`` adds these flags to its parser and, when they ask for more than one
node, hands the parsed flags to :func:`launch_nodes`, which checks them and runs this
node's part of the job (:func:`unison._launch.multinode.run_node`). Kept apart from the
running of a node so that what a user types and what a node does are read separately.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

from unison._launch.core_binding import plan_cores
from unison._launch.multinode import DEFAULT_MASTER_PORT, DEFAULT_RENDEZVOUS_TIMEOUT, plan_node, run_node

__all__ = ["add_multinode_arguments", "is_multinode", "launch_nodes"]


def _port(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port in 1..65535")
    return int(text)


def _positive(kind: type) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            value = 0
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text!r} is not a positive {'integer' if kind is int else 'number'}")
        return value

    return parse


def add_multinode_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the multi-node flags of ``unison launch`` (torchrun's names where it has them)."""
    group = parser.add_argument_group("multi-node (run the same command on every node, each with its --node-rank)")
    group.add_argument("--nnodes", type=_positive(int), default=1, metavar="N", help="number of nodes (default 1)")
    group.add_argument("--node-rank", type=int, default=0, metavar="R", help="this node's rank, 0..N-1 (default 0)")
    group.add_argument("--master-addr", metavar="HOST", help="address of node 0, which hosts the launchers' rendezvous")
    group.add_argument(
        "--master-port", type=_port, default=DEFAULT_MASTER_PORT, metavar="P",
        help=f"port of the rendezvous on node 0 (default {DEFAULT_MASTER_PORT})",
    )
    group.add_argument(
        "--workers-per-node", "--nproc-per-node", type=int, default=None, metavar="K", help="worker tasks on each node"
    )
    group.add_argument(
        "--node-addr", metavar="HOST",
        help="address other nodes reach this node at (default: the one it uses to reach the master)",
    )
    group.add_argument(
        "--rendezvous-timeout",
        type=_positive(float),
        default=DEFAULT_RENDEZVOUS_TIMEOUT,
        metavar="S",
        help=f"seconds to wait for the master and the other nodes (default {DEFAULT_RENDEZVOUS_TIMEOUT:g})",
    )


def is_multinode(args: argparse.Namespace) -> bool:
    """Whether the parsed ``unison launch`` flags ask for a multi-node job."""
    return args.nnodes > 1 or args.master_addr is not None


def launch_nodes(args: argparse.Namespace, parser: argparse.ArgumentParser, command: Sequence[str]) -> int:
    """``unison launch --nnodes N ...``: checks the flags, then runs this node (see :func:`run_node`)."""
    if args.master_addr is None:
        parser.error(
            f"--nnodes {args.nnodes} needs --master-addr HOST, the address of node 0 (which hosts the rendezvous)"
        )
    if args.workers != 1:
        parser.error(
            "--workers is the task count of a one-node cluster; with --nnodes pass --workers-per-node K instead"
        )
    workers = 1 if args.workers_per_node is None else args.workers_per_node
    try:
        plan = plan_node(args.nnodes, args.node_rank, workers, chief=args.chief, ps=args.ps, evaluator=args.evaluator)
    except ValueError as e:
        parser.error(str(e))
    if args.bind_cores:
        try:
            plan_cores(plan.tasks)  # checked here, where the flag can be named in a usage error
        except ValueError as e:
            parser.error(str(e))
    return run_node(
        command,
        plan,
        master_addr=args.master_addr,
        master_port=args.master_port,
        node_addr=args.node_addr,
        max_restarts=args.max_restarts,
        grace_period=args.grace_period,
        rendezvous_timeout=args.rendezvous_timeout,
        bind_cores=args.bind_cores,
    )
