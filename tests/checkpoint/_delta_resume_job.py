"""A one-process training job of a DynamicEmbedding model backed up with tables by delta, run by
test_delta_resume.py in a worker process of its own (``run_workers(train, 1, args=(OUT_DIR, KILL_AT_STEP))``).

It SIGKILLs itself after step KILL_AT_STEP when OUT_DIR/killed.txt does not exist yet (-1: never).
Writes the final model state to OUT_DIR/final.pt and "<restored step>" lines to OUT_DIR/attempts.txt.
"""

from __future__ import annotations

import os
import signal

import torch
from torch import nn

import unison
from unison.embeddings import AdmitAfter, EvictUnseen, Uniform


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = unison.DynamicEmbedding(4, mode="sum", seed=5, initializer=Uniform(-0.3, 0.3),
                                           eviction=EvictUnseen(6), admission=AdmitAfter(2, sketch_width=4096))
        self.head = nn.Linear(4, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids)).squeeze(1)


def train(rank: int, world_size: int, out_dir: str, kill_at: int) -> None:
    del rank, world_size  # one process
    torch.set_num_threads(1)
    strategy = unison.get_strategy()
    torch.manual_seed(0)
    model = Model()
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 150, (400, 3), generator=g) + torch.arange(400).unsqueeze(1) // 2  # a drifting vocabulary
    data = torch.utils.data.TensorDataset(ids, torch.randn(400, generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=16, shuffle=True)
    backup = unison.BackupAndRestore(os.path.join(out_dir, "backup"), strategy,
                                     {"model": model, "optimizer": optimizer}, save_freq=5, full_every=2)
    with open(os.path.join(out_dir, "attempts.txt"), "a") as log:
        log.write(f"{backup.global_step}\n")
    first = not os.path.exists(os.path.join(out_dir, "killed.txt"))
    for _ in backup.epochs(2):  # 25 steps an epoch
        for x, y in backup.batches(loader):
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            if first and backup.global_step + 1 == kill_at:
                chain = sorted(p for p in os.listdir(os.path.join(out_dir, "backup")) if p.startswith("tables-"))
                with open(os.path.join(out_dir, "killed.txt"), "w") as f:
                    f.write(" ".join(chain))
                os.kill(os.getpid(), signal.SIGKILL)
    torch.save(model.state_dict(), os.path.join(out_dir, "final.pt"))
