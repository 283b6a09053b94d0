"""Checkpoints: atomic chief-only files, per-worker write paths, and backups that resume at the exact step.

- :func:`save_checkpoint` / :func:`load_checkpoint`: the chief writes, every worker reads;
  every write is atomic, and a full disk is a clear error that keeps the previous file.
- :func:`write_dirpath`, :func:`write_filepath`, :func:`remove_temp_dirpath`,
  :func:`remove_temp_dir_with_filepath`: where a non-chief worker writes during a
  collective save (TF's ``distributed_file_utils``).
- :class:`BackupAndRestore`: model, optimizer, data position and every worker's random
  generators, saved every N steps or epoch and restored when a restarted job begins.
- :class:`PreemptionCheckpointHandler` / :class:`TerminationConfig`: a SIGTERM to any
  worker makes all of them save at the same step and exit for a restart.
- :class:`SidecarEvaluator` (with :func:`save_step_checkpoint`, :func:`mark_final`): the
  evaluator task evaluates every checkpoint the chief writes, in step order.

Each name is imported on first use (``lazy_loader``; the names and their types are in
``__init__.pyi``), so that the launcher can read what it needs from this package without
importing torch.
"""

import lazy_loader as _lazy

__getattr__, __dir__, __all__ = _lazy.attach_stub(__name__, __file__)
