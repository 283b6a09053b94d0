"""Where each worker writes: the chief to the real path, every other worker to a temporary one.

Every worker of a multi-worker job takes part in a save (the state may need a
collective to gather), but only the chief's file is kept. The others write into
``<dir>/workertemp_<task_id>/`` and remove it afterwards, so that no two workers write
the same file and nothing but the chief's copy remains. The chief never removes its
own files.

tf.distribute equivalent: ``distribute/distributed_file_utils.py`` (``write_dirpath``,
``write_filepath``, ``remove_temp_dirpath``, ``remove_temp_dir_with_filepath``).
"""

from __future__ import annotations

import os
import shutil
from typing import Any

__all__ = ["write_dirpath", "write_filepath", "remove_temp_dirpath", "remove_temp_dir_with_filepath"]


def _is_chief(strategy: Any) -> bool:
    return strategy is None or bool(strategy.extended.should_checkpoint)


def _task_id(strategy: Any) -> int:
    resolver = strategy.cluster_resolver
    task_id = resolver.task_id if resolver is not None else None
    return int(task_id) if task_id is not None else strategy.extended.components.worker_index


def _temp_dir(dirpath: str, strategy: Any) -> str:
    """This worker's temporary directory for ``dirpath``: ``dirpath`` itself when it already is one.

    A path that :func:`write_dirpath` or :func:`write_filepath` returned may come back
    (to remove it, or to write under it again); as in TensorFlow's ``_get_temp_dir``, a
    directory named ``workertemp_<task_id>`` of this worker is recognised instead of
    nesting another one inside it, so the removal reaches the directory the worker wrote.
    """
    name = f"workertemp_{_task_id(strategy)}"
    if os.path.basename(os.path.normpath(dirpath)) == name:
        return dirpath
    return os.path.join(dirpath, name)


def write_dirpath(dirpath: str | os.PathLike[str], strategy: Any) -> str:
    """The directory this worker writes to: ``dirpath`` on the chief, a ``workertemp_<id>`` under it elsewhere.

    The temporary directory is created. ``strategy`` None means a single process (chief).
    """
    dirpath = os.fspath(dirpath)
    if _is_chief(strategy):
        return dirpath
    temp = _temp_dir(dirpath, strategy)
    os.makedirs(temp, exist_ok=True)
    return temp


def write_filepath(filepath: str | os.PathLike[str], strategy: Any) -> str:
    """The file this worker writes: ``filepath`` on the chief, the same name in its temporary directory elsewhere."""
    filepath = os.fspath(filepath)
    dirpath, base = os.path.split(filepath)
    return os.path.join(write_dirpath(dirpath, strategy), base)


def remove_temp_dirpath(dirpath: str | os.PathLike[str], strategy: Any) -> None:
    """Removes this worker's temporary directory under ``dirpath`` (nothing on the chief).

    ``dirpath`` is the original directory or the one :func:`write_dirpath` returned.
    """
    if _is_chief(strategy):
        return
    shutil.rmtree(_temp_dir(os.fspath(dirpath), strategy), ignore_errors=True)


def remove_temp_dir_with_filepath(filepath: str | os.PathLike[str], strategy: Any) -> None:
    """Removes the temporary directory that :func:`write_filepath` gave this worker for ``filepath``.

    ``filepath`` is the original path or the one :func:`write_filepath` returned.
    """
    remove_temp_dirpath(os.path.dirname(os.fspath(filepath)), strategy)
