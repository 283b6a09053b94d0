"""Train a small CNN on scikit-learn's handwritten digits with a unison strategy.

The main job of the project. The same script runs
- on a local cluster:  unison launch --workers 2 examples/digits.py
- with an evaluator beside training:  unison launch --workers 2 --evaluator examples/digits.py
- on two logical CPU devices of one process:  python examples/digits.py --strategy mirrored --devices cpu:0,cpu:1
- on one device:  python examples/digits.py --strategy one_device

Training is backed up every epoch (``unison.BackupAndRestore``): a job that is killed
and restarted resumes at the epoch and batch it had reached, with the same weights it
would have had. To see it: ``unison launch --workers 2 --max-restarts 1
examples/digits.py --fail-at-step 100`` (worker 1 kills itself at step 100 once).

The digits (1,797 8x8 images) ship with scikit-learn: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

import torch
from torch import nn

import unison


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", choices=["multi_worker", "mirrored", "one_device"], default="multi_worker")
    parser.add_argument("--devices", default=None, help="comma-separated devices, e.g. cpu:0,cpu:1")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", default="checkpoints/digits.pt", help="written by the chief each epoch")
    parser.add_argument("--backup-dir", default="checkpoints/digits-backup",
                        help="BackupAndRestore's directory (deleted when training completes)")
    parser.add_argument("--eval-dir", default="checkpoints/digits-eval",
                        help="per-epoch checkpoints the evaluator task (unison launch --evaluator) evaluates")
    parser.add_argument("--compression", choices=["none", "bf16", "fp16", "powersgd"], default="none",
                        help="how gradients travel between workers (multi_worker only; "
                             "CommunicationOptions.compression; powersgd: unison.PowerSGD(rank=--powersgd-rank))")
    parser.add_argument("--powersgd-rank", type=int, default=1, help="the rank of --compression powersgd (default 1)")
    parser.add_argument("--amp", action="store_true",
                        help="mixed precision: bfloat16 autocast and a torch.amp.GradScaler in the step")
    parser.add_argument("--fail-at-step", type=int, default=None,
                        help="worker 1 kills itself at this global step on the first attempt (to see a resume)")
    return parser.parse_args(argv)


def make_strategy(args: argparse.Namespace) -> unison.Strategy:
    devices = args.devices.split(",") if args.devices else None
    if args.strategy == "one_device":
        return unison.OneDeviceStrategy(devices[0] if devices else "cpu:0")
    if args.strategy == "mirrored":
        return unison.MirroredStrategy(devices)
    return unison.MultiWorkerMirroredStrategy(
        communication_options=unison.CommunicationOptions(
            timeout_seconds=60,
            compression=(unison.PowerSGD(rank=args.powersgd_rank) if args.compression == "powersgd"
                         else args.compression)),
        devices=devices
    )


def load_digits(seed: int) -> tuple[torch.utils.data.TensorDataset, torch.utils.data.TensorDataset]:
    from sklearn.datasets import load_digits as sklearn_digits
    from sklearn.model_selection import train_test_split

    digits = sklearn_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.int64)
    train_idx, test_idx = train_test_split(
        range(len(labels)), test_size=0.2, random_state=seed, stratify=digits.target
    )
    mean, std = images[train_idx].mean(), images[train_idx].std()
    images = (images - mean) / std
    return (torch.utils.data.TensorDataset(images[train_idx], labels[train_idx]),
            torch.utils.data.TensorDataset(images[test_idx], labels[test_idx]))


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10),
    )


def run_evaluator(args: argparse.Namespace) -> dict:
    """The evaluator task: evaluates each epoch's checkpoint as the chief writes it."""
    _, test_set = load_digits(args.seed)
    loader = torch.utils.data.DataLoader(test_set, batch_size=256)
    results = unison.SidecarEvaluator(make_model(), loader, args.eval_dir).start()
    print(f"evaluator: evaluated {len(results)} checkpoints (steps {sorted(results)})", flush=True)
    return {"evaluations": results}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    if unison.TFConfigClusterResolver().task_type == "evaluator":
        return run_evaluator(args)
    strategy = make_strategy(args)
    chief = strategy.extended.should_checkpoint
    train_set, test_set = load_digits(args.seed)
    with strategy.scope():
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    train_data = strategy.experimental_distribute_dataset(
        train_set, global_batch_size=args.batch_size, shuffle=True, seed=args.seed)
    test_data = strategy.experimental_distribute_dataset(test_set, global_batch_size=args.batch_size)

    # one scaler for the process, as on one device: unison makes every replica thread share it
    device_type = torch.device(strategy.extended.worker_devices[0]).type
    scaler = torch.amp.GradScaler(device_type, enabled=args.amp)

    def train_step(batch):
        images, labels = batch
        optimizer.zero_grad()
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=args.amp):
            loss = nn.functional.cross_entropy(model(images), labels)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        return loss.detach()

    def eval_step(batch):
        images, labels = batch
        with torch.no_grad():
            correct = (model(images).argmax(dim=1) == labels).sum().float()
        return correct, torch.tensor(float(labels.numel()))

    def evaluate() -> float:
        correct = total = 0.0
        for batch in test_data:
            c, n = strategy.run(eval_step, args=(batch,))
            correct += strategy.reduce("sum", c).item()
            total += strategy.reduce("sum", n).item()
        return correct / total

    if chief:
        workers = strategy.num_replicas_in_sync // len(strategy.extended.worker_devices)
        print(f"{type(strategy).__name__}: {strategy.num_replicas_in_sync} replicas on {workers} worker(s), "
              f"devices {list(strategy.extended.worker_devices)}; {len(train_set)} training and "
              f"{len(test_set)} test digits; global batch {args.batch_size}", flush=True)
    backup = unison.BackupAndRestore(args.backup_dir, strategy,
                                     {"model": model, "optimizer": optimizer, "scheduler": scheduler})
    first_attempt = strategy.extended.components.cluster.restart_count == 0
    if backup.restored and chief:
        print(f"resumed from the backup in {args.backup_dir}: epoch {backup.epoch + 1}, step {backup.global_step}",
              flush=True)
    seen, started, accuracy = 0, time.perf_counter(), 0.0
    for epoch in backup.epochs(args.epochs):
        losses = []
        batches = backup.batches(train_data)
        # A live bar on a terminal; in a log, a plain line every 10 s and one per epoch.
        for batch in unison.progress.track(batches, desc=f"epoch {epoch + 1}/{args.epochs}", disable=not chief,
                                           total=len(train_data), initial=backup.step_in_epoch):
            losses.append(strategy.reduce("mean", strategy.run(train_step, args=(batch,))).item())
            seen += args.batch_size
            if (args.fail_at_step is not None and first_attempt and backup.global_step + 1 == args.fail_at_step
                    and strategy.extended.components.worker_index == 1):
                print(f"worker 1 kills itself at step {args.fail_at_step} (--fail-at-step)", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        scheduler.step()
        accuracy = evaluate()
        state = {"epoch": epoch + 1, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                 "accuracy": accuracy}
        unison.save_checkpoint(state, args.checkpoint, strategy)
        unison.save_step_checkpoint(state, args.eval_dir, epoch + 1, strategy)
        if chief:
            print(f"epoch {epoch + 1:2d}: loss {sum(losses) / max(len(losses), 1):.4f}  test accuracy {accuracy:.4f}",
                  flush=True)
    unison.mark_final(args.eval_dir, args.epochs, strategy)
    elapsed = time.perf_counter() - started
    summary = {
        "accuracy": accuracy, "samples_per_second": seen / elapsed, "replicas": strategy.num_replicas_in_sync,
        "seconds": elapsed, "checkpoint": str(Path(args.checkpoint)) if chief else None,
    }
    if chief:
        print(f"summary: test accuracy {accuracy:.4f}, {summary['samples_per_second']:.0f} samples/s, "
              f"{strategy.num_replicas_in_sync} replicas, {elapsed:.1f} s; checkpoint {args.checkpoint}", flush=True)
    return summary


if __name__ == "__main__":
    main()
