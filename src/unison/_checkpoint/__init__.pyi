"""Types of ``unison._checkpoint``'s names, for type checkers; ``__init__.py`` loads each on first use."""


from .backup import BackupAndRestore
from .files import atomic_save, load_checkpoint, save_checkpoint
from .paths import remove_temp_dir_with_filepath, remove_temp_dirpath, write_dirpath, write_filepath
from .preemption import PREEMPTED_EXIT_CODE, PreemptionCheckpointHandler, TerminationConfig
from .sidecar import SidecarEvaluator, mark_final, save_step_checkpoint

__all__ = [
    "BackupAndRestore",
    "PreemptionCheckpointHandler",
    "TerminationConfig",
    "PREEMPTED_EXIT_CODE",
    "SidecarEvaluator",
    "save_step_checkpoint",
    "mark_final",
    "atomic_save",
    "load_checkpoint",
    "save_checkpoint",
    "write_dirpath",
    "write_filepath",
    "remove_temp_dirpath",
    "remove_temp_dir_with_filepath",
]
