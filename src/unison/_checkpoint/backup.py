"""BackupAndRestore: a job that is killed and restarted resumes at the exact step.

A backup holds everything the next step depends on: the state dicts of the objects it
was given (model, optimizer, scheduler, ...), the epoch and the step within it (so the
data pipeline skips exactly the batches already trained on), and every worker's own
random-number generators (torch, Python's ``random``, NumPy when present) — both as
they were when the epoch's data iterator was made (shuffling draws from them then) and
as they are at the step. A job that restarts after a fault therefore ends with the
weights it would have had without it.

Saving is collective: every worker writes its generators' file, all wait, then the chief
writes the backup (atomically) and the workers drop their older files. On creation the
latest backup is restored on every worker; when training finishes the backup is deleted
(unless ``delete_checkpoint=False``). The backup directory must be visible to every
worker (one host, or shared storage).

The loop::

    backup = unison.BackupAndRestore("backup/", strategy, {"model": model, "optimizer": opt}, save_freq=10)
    for epoch in backup.epochs(num_epochs):      # starts at the restored epoch
        for batch in backup.batches(dataset):    # skips the batches the restored step had trained on
            strategy.run(step_fn, args=(batch,))

Embedding tables by delta (``full_every=K``): a model's ``DynamicEmbedding`` tables are most
of its bytes and change by a few per cent between saves, so with ``full_every`` each save
writes the tables apart, in ``tables-<step>.pt``: a full save point, then ``K`` saves that
hold only what changed since the one before (``delta_state_dict``), then a full one again;
everything else is saved whole every time. The main file names the chain it needs, and is
written after the chain's newest file, so a kill at any point leaves a backup that loads:
a restarted job loads the full file and applies the deltas in order.

tf.distribute equivalent: ``tf.keras.callbacks.BackupAndRestore`` (Keras' fit loop owns
the counters there; here the two generators do).
"""

from __future__ import annotations

import os
import typing
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from unison._checkpoint.collective_save import (
    capture_generators,
    check_state,
    collective_save,
    generator_file,
    load_main,
    restore_generators,
)
from unison._checkpoint.files import atomic_save
from unison._checkpoint.table_saves import delta_saving_modules, leaving_tables_out
from unison.errors import CheckpointError

__all__ = ["BackupAndRestore"]

_BACKUP = "backup.pt"


@typing.final
class BackupAndRestore:
    """Backs up training state at a chosen frequency and restores it when the job restarts.

    Args:
        backup_dir: a directory for the backup, visible to every worker.
        strategy: the strategy training runs under (its chief writes the backup).
        state: name -> object with ``state_dict()`` and ``load_state_dict()`` (model,
            optimizer, learning-rate scheduler, ...).
        save_freq: ``"epoch"`` (after every epoch) or a number of steps.
        delete_checkpoint: delete the backup when :meth:`epochs` completes.
        full_every: None (every save holds the tables whole), or ``K``: the embedding tables
            in ``state`` (modules with ``delta_state_dict``, e.g. ``unison.DynamicEmbedding``,
            as entries or submodules) are saved as a full save point, then ``K`` deltas, then
            a full one again.

    Raises:
        ValueError: for a bad ``save_freq`` or ``full_every``, ``full_every`` without a table
            in ``state``, or an empty ``state``.
        TypeError: for a ``state`` entry without ``state_dict``/``load_state_dict``.
        CheckpointError: if the backup found cannot be restored into ``state``.
    """

    def __init__(self, backup_dir: str | os.PathLike[str], strategy: Any, state: Mapping[str, Any],
                 save_freq: str | int = "epoch", delete_checkpoint: bool = True, full_every: int | None = None):
        if save_freq != "epoch" and (isinstance(save_freq, bool) or not isinstance(save_freq, int) or save_freq < 1):
            raise ValueError(f"save_freq must be 'epoch' or a positive number of steps, got {save_freq!r}")
        if full_every is not None and (isinstance(full_every, bool) or not isinstance(full_every, int)
                                       or full_every < 0):
            raise ValueError(f"BackupAndRestore: `full_every` must be None or the number of delta saves between two "
                             f"full ones (an int >= 0), got {full_every!r}")
        self._state = check_state(state)
        self._full_every = full_every
        self._tables = delta_saving_modules(self._state) if full_every is not None else {}
        if full_every is not None and not self._tables:
            raise ValueError(f"BackupAndRestore: `full_every={full_every}` saves embedding tables by delta, but no "
                             f"entry of `state` ({sorted(self._state)}) is or holds a module with delta_state_dict "
                             f"(e.g. unison.DynamicEmbedding); fix: pass the model that holds the tables, or drop "
                             f"full_every")
        self._chain: list[str] = []
        self._dir = Path(backup_dir)
        self._strategy = strategy
        self._save_freq = save_freq
        self._delete = bool(delete_checkpoint)
        self._rank = strategy.extended.components.worker_index
        self._workers = strategy.extended.components.num_workers
        self.epoch = 0
        """The epoch training is in (restored from the backup)."""
        self.step_in_epoch = 0
        """Batches of the current epoch already trained on."""
        self.global_step = 0
        """Steps trained on since the job first started, restarts included."""
        self._epoch_rng: dict[str, Any] | None = None
        self.restored = self._restore()
        """Whether a backup was found and restored on creation."""

    # -- the loop ---------------------------------------------------------------------
    def epochs(self, num_epochs: int) -> Iterator[int]:
        """The epochs still to train, from the restored one; deletes the backup when all are done.

        With ``save_freq="epoch"`` a backup is saved after each epoch.
        """
        for epoch in range(self.epoch, num_epochs):
            self.epoch = epoch
            yield epoch
            self.epoch, self.step_in_epoch = epoch + 1, 0
            self._epoch_rng = None
            if self._save_freq == "epoch" and self.epoch < num_epochs:
                self.save()
        self.finish()

    def batches(self, dataset: Iterable[Any]) -> Iterator[Any]:
        """This epoch's batches of ``dataset``, after the ones the restored step had trained on.

        Calls ``dataset.set_epoch(epoch)`` when it has one (unison's distributed datasets
        and samplers shuffle by it) and makes the iterator with the generators as they
        were when the epoch first began, so a resumed epoch yields the same batches in the
        same order. With ``save_freq=N``, a backup is saved after every N-th step.
        """
        set_epoch = getattr(dataset, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(self.epoch)
        resume_rng = None
        if self._epoch_rng is not None and self.step_in_epoch:
            resume_rng = capture_generators()
            restore_generators(self._epoch_rng)  # the generators the epoch's iterator was made with
        else:
            self._epoch_rng = capture_generators()
        iterator = iter(dataset)
        for _ in range(self.step_in_epoch):
            next(iterator)
        if resume_rng is not None:
            restore_generators(resume_rng)
        for batch in iterator:
            yield batch
            self.step_in_epoch += 1
            self.global_step += 1
            if self._save_freq != "epoch" and self.global_step % int(self._save_freq) == 0:
                self.save()

    # -- saving and restoring ----------------------------------------------------------------
    def save(self) -> None:
        """Saves a backup now (every worker calls it at the same step: it is collective)."""
        step = self.global_step
        collective_save(
            self._dir, _BACKUP, step, self._rank, {"rng": capture_generators(), "epoch_rng": self._epoch_rng},
            lambda: self._main(step), self._barrier,
        )
        if self._rank == 0 and self._tables:
            for path in self._dir.glob("tables-*.pt"):
                if path.name not in self._chain:
                    path.unlink(missing_ok=True)

    def _main(self, step: int) -> dict[str, Any]:
        """The chief's part of a save: with ``full_every``, the tables' file of the chain first, then the rest."""
        main: dict[str, Any] = {"step": step, "epoch": self.epoch, "step_in_epoch": self.step_in_epoch,
                                "workers": self._workers}
        if not self._tables:
            main["state"] = {k: v.state_dict() for k, v in self._state.items()}
            return main
        assert self._full_every is not None
        full = not self._chain or len(self._chain) > self._full_every
        name = f"tables-{step}.pt"
        atomic_save({key: module.delta_state_dict(full=full) for key, module in self._tables.items()},
                    self._dir / name)
        self._chain = [name] if full else [*self._chain, name]
        with leaving_tables_out():
            main["state"] = {k: v.state_dict() for k, v in self._state.items()}
        main["tables"] = list(self._chain)
        return main

    def _restore(self) -> bool:
        backup = load_main(self._dir, _BACKUP, self._state, self._workers)
        if backup is None:
            return False
        self.global_step, self.epoch, self.step_in_epoch = backup["step"], backup["epoch"], backup["step_in_epoch"]
        self._chain = list(backup.get("tables") or [])
        rng_path = generator_file(self._dir, self.global_step, self._rank)
        if not rng_path.is_file():
            raise CheckpointError(f"the backup in {str(self._dir)!r} is at step {self.global_step} but worker "
                                  f"{self._rank}'s generators for that step ({rng_path.name}) are missing")
        rng = torch.load(rng_path, map_location="cpu", weights_only=False)
        restore_generators(rng["rng"])
        self._epoch_rng = rng["epoch_rng"]
        return True

    def finish(self) -> None:
        """Training is done: deletes the backup (unless ``delete_checkpoint=False``)."""
        if not self._delete:
            return
        self._barrier()
        for path in self._dir.glob(f"rng-*-w{self._rank}.pt"):
            path.unlink(missing_ok=True)
        self._barrier()
        if self._rank == 0:
            (self._dir / _BACKUP).unlink(missing_ok=True)
            for path in self._dir.glob("tables-*.pt"):
                path.unlink(missing_ok=True)
            try:
                self._dir.rmdir()
            except OSError:
                pass  # not empty: something else lives there too

    def _barrier(self) -> None:
        if self._workers > 1:  # any all-reduce across the workers waits for all of them
            self._strategy.reduce("sum", torch.zeros(()))

    def __repr__(self) -> str:
        return (f"BackupAndRestore({str(self._dir)!r}, epoch={self.epoch}, step_in_epoch={self.step_in_epoch}, "
                f"global_step={self.global_step}, save_freq={self._save_freq!r})")
