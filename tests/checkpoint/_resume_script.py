"""A 2-worker training job with BackupAndRestore, run under `unison launch` by the resume tests.

Usage: python _resume_script.py OUT_DIR KILL_AT_STEP SAVE_FREQ
Worker 1 SIGKILLs itself after step KILL_AT_STEP on the first attempt (-1: never). The
chief writes the final weights to OUT_DIR/final.pt and each attempt appends
"<attempt> <restored step> <time.time()>" to OUT_DIR/attempts-w<rank>.txt.
``as_worker`` runs it as one worker of the same cluster in a ``run_workers`` process.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
from torch import nn

import unison
from unison._testing import as_launched_worker


def main(argv: list[str] | None = None) -> None:
    out_dir, kill_at, save_freq = argv if argv is not None else sys.argv[1:4]
    kill_at = int(kill_at)
    strategy = unison.MultiWorkerMirroredStrategy(
        communication_options=unison.CommunicationOptions(timeout_seconds=20))
    components = strategy.extended.components
    rank, attempt = components.worker_index, components.cluster.restart_count
    with strategy.scope():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 4))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=30, gamma=0.5)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(400, 8, generator=g), torch.randint(0, 4, (400,), generator=g))
    dataset = strategy.experimental_distribute_dataset(data, global_batch_size=16, shuffle=True, seed=3)
    backup = unison.BackupAndRestore(os.path.join(out_dir, "backup"), strategy,
                                     {"model": model, "optimizer": optimizer, "scheduler": scheduler},
                                     save_freq="epoch" if save_freq == "epoch" else int(save_freq))
    with open(os.path.join(out_dir, f"attempts-w{rank}.txt"), "a") as log:
        log.write(f"{attempt} {backup.global_step} {time.time()}\n")

    def step(x, y):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        scheduler.step()
        return loss

    for _ in backup.epochs(4):  # 25 steps an epoch
        for x, y in backup.batches(dataset):
            strategy.run(step, args=(x, y))
            if attempt == 0 and rank == 1 and backup.global_step + 1 == kill_at:
                with open(os.path.join(out_dir, "killed.txt"), "w") as f:
                    f.write(f"{time.time()}\n")
                os.kill(os.getpid(), signal.SIGKILL)
    if strategy.extended.should_checkpoint:
        torch.save([p.detach().clone() for p in model.parameters()], os.path.join(out_dir, "final.pt"))


def as_worker(rank: int, world_size: int, *argv: str) -> None:
    """``main(argv)`` as worker ``rank`` of ``world_size`` in a ``run_workers`` process."""
    as_launched_worker(rank, world_size)
    main(list(argv))


if __name__ == "__main__":
    main()
