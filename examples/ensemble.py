"""An AdaNet-style ensemble trained on a parameter-server cluster, placed by unison.placement.

Run (every task runs this script; workers and ps tasks serve, the chief coordinates):

    unison launch --chief --workers 4 --ps 2 examples/ensemble.py --placement round_robin
    unison launch --chief --workers 4 --ps 2 examples/ensemble.py --placement replication

The ensemble is k subnetworks of different depth and width plus learned mixture weights
over their logits, on scikit-learn's digits. With ``round_robin`` each worker does what
``RoundRobinStrategy`` assigns it (worker 0 trains the mixture weights on the frozen
forward passes of all subnetworks; every other worker trains one subnetwork) and each
subnetwork's parameters live on its dedicated ps group; with ``replication`` every
worker trains everything. The chief evaluates every subnetwork and the ensemble, prints
a table with the time and how many parameter tensors each worker pulled, and
checkpoints the ensemble.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import nn

import unison
from unison.placement import PlacementConfig, ReplicationStrategy, RoundRobinStrategy

WIDTHS = ((32,), (64, 32), (128,))  # the subnetworks: hidden layer widths


def make_subnetwork(widths: tuple[int, ...]) -> nn.Module:
    layers: list[nn.Module] = [nn.Flatten()]
    size = 64
    for width in widths:
        layers += [nn.Linear(size, width), nn.ReLU()]
        size = width
    return nn.Sequential(*layers, nn.Linear(size, 10))


def load_digits() -> tuple[torch.utils.data.TensorDataset, torch.utils.data.TensorDataset]:
    from sklearn.datasets import load_digits as sklearn_digits
    from sklearn.model_selection import train_test_split

    digits = sklearn_digits()
    images = torch.tensor(digits.images, dtype=torch.float32) / 16.0
    labels = torch.tensor(digits.target)
    train, test = train_test_split(range(len(labels)), test_size=0.25, random_state=0, stratify=digits.target)
    return (torch.utils.data.TensorDataset(images[train], labels[train]),
            torch.utils.data.TensorDataset(images[test], labels[test]))


def make_placement(kind: str) -> RoundRobinStrategy | ReplicationStrategy:
    return RoundRobinStrategy() if kind == "round_robin" else ReplicationStrategy()


def parameter_count(module: nn.Module) -> int:
    return sum(1 for _ in module.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--placement", choices=["round_robin", "replication"], default="round_robin")
    parser.add_argument("--steps", type=int, default=300, help="functions scheduled (one batch each)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--checkpoint", default="checkpoints/ensemble.pt")
    parser.add_argument("--report", default=None, help="also write the results as JSON here")
    args = parser.parse_args()

    resolver = unison.TFConfigClusterResolver()
    if resolver.task_type in ("worker", "ps"):
        unison.Server(resolver).join()  # serves until the coordinator shuts the cluster down
        return

    started = time.perf_counter()
    strategy = unison.ParameterServerStrategy(resolver)
    coordinator = unison.ClusterCoordinator(strategy)
    num_workers, num_ps, k = len(strategy.ps_cluster.workers), len(strategy.ps_cluster.ps), len(WIDTHS)
    placement = make_placement(args.placement)
    placement.config = PlacementConfig(num_worker_replicas=num_workers, global_id_in_cluster=0, num_ps_replicas=num_ps)
    torch.manual_seed(0)
    with strategy.scope():
        subnetworks = []
        for index, widths in enumerate(WIDTHS):
            with placement.subnetwork_devices(k, index):  # round_robin: on the subnetwork's own ps group
                subnetworks.append(make_subnetwork(widths))
        mixture = unison.Variable(torch.zeros(k), name="mixture")
        # Adam (its moments live next to each tensor on the ps) stays stable under the
        # asynchronous updates of several workers (replication), where SGD with momentum diverged
        sub_optimizers = [torch.optim.Adam(s.parameters(), lr=0.01) for s in subnetworks]
        mixture_optimizer = torch.optim.Adam([mixture], lr=0.1)
    placements = {f"subnetwork {i}": sorted(set(strategy.extended.variable_placement(p) for p in s.parameters()))
                  for i, s in enumerate(subnetworks)}
    train_set, test_set = load_digits()

    def dataset_fn(context: unison.InputContext):
        loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size, shuffle=True,
                                             generator=torch.Generator().manual_seed(context.input_pipeline_id))
        while True:  # each worker's own endless stream, tagged with the worker's index
            for x, y in loader:
                yield context.input_pipeline_id, x, y

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
    kind = args.placement

    def step(per_worker):
        worker, x, y = next(per_worker)
        mine = make_placement(kind)
        mine.config = PlacementConfig(num_worker_replicas=num_workers, global_id_in_cluster=worker,
                                      num_ps_replicas=num_ps)
        built = [i for i in range(k) if mine.should_build_subnetwork(k, i)]
        trained = []
        if mine.should_train_subnetworks(k):
            for i in built:
                sub_optimizers[i].zero_grad()
                F.cross_entropy(subnetworks[i](x), y).backward()
                sub_optimizers[i].step()
                trained.append(i)
        ensemble = mine.should_build_ensemble(k)
        if ensemble:  # the mixture weights, on the subnetworks' frozen forward passes
            with torch.no_grad():
                logits = torch.stack([subnetworks[i](x) for i in range(k)])
            mixture_optimizer.zero_grad()
            mixed = (torch.softmax(mixture, 0)[:, None, None] * logits).sum(0)
            F.cross_entropy(mixed, y).backward()
            mixture_optimizer.step()
        used = set(built) | (set(range(k)) if ensemble else set())
        fetched = sum(parameter_count(subnetworks[i]) for i in used) + (1 if ensemble else 0)
        return {"worker": worker, "trained": trained, "ensemble": ensemble, "fetched": fetched}

    results = [coordinator.schedule(step, args=(iterator,)) for _ in range(args.steps)]
    coordinator.join()
    per_worker: dict[int, dict] = defaultdict(
        lambda: {"functions": 0, "fetched": 0, "trained": set(), "ensemble": False})
    for result in coordinator.fetch(results):
        row = per_worker[result["worker"]]
        row["functions"] += 1
        row["fetched"] += result["fetched"]
        row["trained"].update(result["trained"])
        row["ensemble"] = row["ensemble"] or result["ensemble"]
    elapsed = time.perf_counter() - started

    x, y = test_set.tensors
    with torch.no_grad():  # on the coordinator: parameters read from the ps tasks
        logits = torch.stack([s(x) for s in subnetworks])
        accuracy = {f"subnetwork {i}": (logits[i].argmax(1) == y).float().mean().item() for i in range(k)}
        weights = torch.softmax(mixture.read_value(), 0)
        accuracy["ensemble"] = ((weights[:, None, None] * logits).sum(0).argmax(1) == y).float().mean().item()
    print(f"placement {kind}: {num_workers} workers, {num_ps} ps, {args.steps} functions, {elapsed:.1f} s")
    print(f"{'model':<14} {'test accuracy':>13}  ps tasks")
    for name, value in accuracy.items():
        print(f"{name:<14} {value:>13.4f}  {', '.join(placements.get(name, ['(all)']))}")
    print(f"{'worker':<7} {'functions':>9} {'param tensors pulled':>21}  trained")
    for worker in sorted(per_worker):
        row = per_worker[worker]
        what = [f"subnetwork {i}" for i in sorted(row["trained"])] + (["mixture"] if row["ensemble"] else [])
        print(f"{worker:<7} {row['functions']:>9} {row['fetched']:>21}  {', '.join(what)}")
    unison.save_checkpoint({"subnetworks": [s.state_dict() for s in subnetworks],
                            "mixture": mixture.read_value()}, args.checkpoint, strategy)
    if args.report:
        with open(args.report, "w") as f:
            json.dump({"placement": kind, "seconds": elapsed, "accuracy": accuracy, "placements": placements,
                       "workers": {w: {**r, "trained": sorted(r["trained"])} for w, r in per_worker.items()}}, f)


if __name__ == "__main__":
    main()
