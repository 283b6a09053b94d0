"""A 2-worker job under PreemptionCheckpointHandler; one worker SIGTERMs itself on the first attempt.

Usage: python _preemption_script.py OUT_DIR SIGNAL_RANK SIGNAL_AT_CALL
Each attempt appends "<attempt> <total_run_calls at start>" to OUT_DIR/attempts-w<rank>.txt,
and each worker that leaves through exit_fn appends "<calls>" to OUT_DIR/saved-w<rank>.txt.
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
from unison._checkpoint import PREEMPTED_EXIT_CODE
from unison._testing import as_launched_worker


def main(argv: list[str] | None = None) -> None:
    out_dir, signal_rank, signal_at = argv if argv is not None else sys.argv[1:4]
    signal_rank, signal_at = int(signal_rank), int(signal_at)
    strategy = unison.MultiWorkerMirroredStrategy(
        communication_options=unison.CommunicationOptions(timeout_seconds=20))
    components = strategy.extended.components
    rank, attempt = components.worker_index, components.cluster.restart_count
    with strategy.scope():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 4))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def leave() -> None:
        with open(os.path.join(out_dir, f"saved-w{rank}.txt"), "a") as f:
            f.write(f"{handler.total_run_calls}\n")
        sys.exit(PREEMPTED_EXIT_CODE)

    handler = unison.PreemptionCheckpointHandler(strategy, os.path.join(out_dir, "ckpt"),
                                                 {"model": model, "optimizer": optimizer},
                                                 unison.TerminationConfig(exit_fn=leave))
    with open(os.path.join(out_dir, f"attempts-w{rank}.txt"), "a") as log:
        log.write(f"{attempt} {handler.total_run_calls} {time.time()}\n")
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(400, 8, generator=g), torch.randint(0, 4, (400,), generator=g))
    dataset = strategy.experimental_distribute_dataset(data, global_batch_size=16, shuffle=True, seed=3)

    def step(x, y):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    steps_per_epoch = 25
    with handler.watch_preemption_scope():
        for epoch in range(handler.total_run_calls // steps_per_epoch, 4):
            dataset.set_epoch(epoch)
            batches = iter(dataset)
            for _ in range(handler.total_run_calls % steps_per_epoch):
                next(batches)  # the batches this epoch already trained on before the restart
            for x, y in batches:
                if attempt == 0 and rank == signal_rank and handler.total_run_calls == signal_at:
                    with open(os.path.join(out_dir, "signalled.txt"), "w") as f:
                        f.write(f"{time.time()}\n")
                    os.kill(os.getpid(), signal.SIGTERM)
                handler.run(lambda: strategy.run(step, args=(x, y)))  # noqa: B023 - called within the iteration
    if strategy.extended.should_checkpoint:
        torch.save([p.detach().clone() for p in model.parameters()], os.path.join(out_dir, "final.pt"))


def as_worker(rank: int, world_size: int, *argv: str) -> None:
    """``main(argv)`` as worker ``rank`` of ``world_size`` in a ``run_workers`` process."""
    as_launched_worker(rank, world_size)
    main(list(argv))


if __name__ == "__main__":
    main()
