"""``unison.embeddings.ServingExporter``: a training job publishes its model for serving every few seconds.

Online training serves the model while it trains on a stream. The training loop calls
:meth:`ServingExporter.maybe_export` after each step; once ``every_seconds`` have passed
since the previous snapshot began, it writes the next one (``snapshots``' layout): each
table's serving export (the first snapshot full, later ones the rows changed since the
snapshot before) and the dense layers' state_dict, under a temporary name, renamed into
place. A :class:`~unison.embeddings.ServingFollower` in the serving process applies each
one as it appears.

:meth:`~ServingExporter.maybe_export` (the training loop's call) takes the rows and the dense
state on the caller's thread, then writes and publishes the files on a thread of its own
while training goes on: the step waits for the gather, not for the disk. One snapshot is
written at a time, in order; :meth:`~ServingExporter.flush` waits for it, and a write that
failed is raised by the next call (the snapshot after it is full).

Why snapshots of deltas, with a full one now and then: a delta holds what a few seconds
of training changed (a small part of a large table), so the interval can be short; but a
server that starts late would replay every delta since the job began, so ``full_every``
starts a new chain now and then, and ``keep_chains`` removes chains older than the
newest few.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, final

import torch
from torch import nn

from unison._embeddings.modules.dynamic_embedding import DynamicEmbedding
from unison._embeddings.serving import snapshots
from unison._embeddings.serving.files import write_export

__all__ = ["ServingExporter"]

DENSE_FILE = "dense.pt"


@final
class ServingExporter:
    """Writes numbered serving snapshots of a model's tables and dense layers under ``root``, every few seconds.

    Call it from one process (the chief; worker 0 under the hybrid strategy): each
    export moves the tables' export chains. On ps tasks each table's rows are gathered
    from every ps task, shard by shard; rows pushed by other workers while that runs
    land in this snapshot or the next.

    Example:
        >>> import tempfile, unison
        >>> emb = unison.DynamicEmbedding(4, mode="sum")
        >>> exporter = unison.embeddings.ServingExporter(tempfile.mkdtemp(), {"table": emb}, every_seconds=5.0)
        >>> _ = emb(torch.tensor([[1, 2]]))
        >>> exporter.export().name          # the first is full; maybe_export() writes one every 5 s
        '000000'

    Args:
        root: the directory of the snapshots (made if missing). A root that holds
            snapshots of an earlier run is continued: numbers go on after its newest,
            and the first snapshot of this run is full (a new chain).
        embeddings: the tables to export, by name (the name of each one's directory in a
            snapshot and its key in ``ServingFollower.embeddings``).
        every_seconds: :meth:`maybe_export` writes a snapshot once this many seconds have
            passed since the previous one began (or since this exporter was made).
        dense: a module whose ``state_dict()`` is saved beside the tables (``dense.pt``;
            the model itself, typically): the entries of its ``DynamicEmbedding``
            submodules are left out (they are the tables), so every one of them must be in
            ``embeddings``. None: no dense state.
        full_every: deltas between two full snapshots (``0``: every snapshot full; None:
            only the first), as ``BackupAndRestore``'s ``full_every``.
        keep_chains: after a full snapshot, keep the newest this many chains (a full
            snapshot and its deltas) and remove older ones; 2 (the default) keeps the
            chain a follower may still be reading. None keeps every snapshot.
        clock: seconds of a monotonic clock, for the interval (tests pass their own).
        background: :meth:`maybe_export` writes the files on a thread of its own (False:
            on the caller's, as :meth:`export` always does).

    Raises:
        TypeError: a table that is not a ``DynamicEmbedding``, or ``dense`` not an
            ``nn.Module``.
        ValueError: no tables, a bad name, interval, ``full_every`` or ``keep_chains``, or a
            ``DynamicEmbedding`` inside ``dense`` that is not in ``embeddings``.

    tf.distribute equivalent: none (TensorFlow Serving polls a directory of numbered
    SavedModel versions, each whole; these are deltas of the tables).
    """

    def __init__(self, root: str | os.PathLike[str], embeddings: Mapping[str, DynamicEmbedding], *,
                 every_seconds: float, dense: nn.Module | None = None, full_every: int | None = None,
                 keep_chains: int | None = 2, clock: Callable[[], float] = time.monotonic,
                 background: bool = True) -> None:
        where = "ServingExporter"
        if not isinstance(embeddings, Mapping) or not embeddings:
            raise ValueError(f"{where}: `embeddings` must be a non-empty dict of name -> DynamicEmbedding, got "
                             f"{embeddings!r:.80}; fix: e.g. {{'table': model.embeddings}}")
        for name, module in embeddings.items():
            snapshots.check_table_name(name, where)
            if not isinstance(module, DynamicEmbedding):
                raise TypeError(f"{where}: `embeddings[{name!r}]` must be a unison.DynamicEmbedding, got "
                                f"{type(module).__name__}; fix: pass the embedding module itself")
        if isinstance(every_seconds, bool) or not isinstance(every_seconds, (int, float)) or not every_seconds > 0:
            raise ValueError(f"{where}: `every_seconds` must be a number > 0, got {every_seconds!r}; fix: the "
                             f"seconds between two snapshots, e.g. 5.0")
        if full_every is not None and (isinstance(full_every, bool) or not isinstance(full_every, int)
                                       or full_every < 0):
            raise ValueError(f"{where}: `full_every` must be an int >= 0 (deltas between two full snapshots) or "
                             f"None (only the first is full), got {full_every!r}")
        if keep_chains is not None and (isinstance(keep_chains, bool) or not isinstance(keep_chains, int)
                                        or keep_chains < 1):
            raise ValueError(f"{where}: `keep_chains` must be an int >= 1 (chains of snapshots kept) or None (keep "
                             f"all), got {keep_chains!r}; fix: 2 keeps the chain a follower may still read")
        if dense is not None and not isinstance(dense, nn.Module):
            raise TypeError(f"{where}: `dense` must be an nn.Module (its state_dict is saved) or None, got "
                            f"{type(dense).__name__}")
        self.root = Path(root)
        self._embeddings = dict(embeddings)
        self._dense = dense
        self._holders = _holders(dense, self._embeddings) if dense is not None else frozenset()
        self.every_seconds = float(every_seconds)
        self.full_every, self.keep_chains = full_every, keep_chains
        self._clock = clock
        self._last_began = clock()
        self.root.mkdir(parents=True, exist_ok=True)
        existing = snapshots.list_snapshots(self.root)
        self._next = existing[-1] + 1 if existing else 0
        self._chain: int | None = None  # the number of the current chain's full snapshot; None: next is full
        self._deltas = 0
        self.last: Path | None = None
        """The newest snapshot this exporter published, or None."""
        self.background = bool(background)
        self._writing: threading.Thread | None = None
        self._failure: BaseException | None = None

    @property
    def next_number(self) -> int:
        """The number the next snapshot gets."""
        return self._next

    def due(self) -> bool:
        """Whether ``every_seconds`` have passed since the previous snapshot began."""
        return self._clock() - self._last_began >= self.every_seconds

    def maybe_export(self, info: Mapping[str, Any] | None = None) -> Path | None:
        """The next snapshot, if ``every_seconds`` have passed since the previous one began; else None.

        Cheap when not due (one clock read): call it after every training step. When due, it
        takes the rows and the dense state now and (``background``) returns the path the
        snapshot is published at once its files are written, on the exporter's own thread;
        :meth:`flush` waits for that.
        """
        return self._export(info, None, wait=not self.background) if self.due() else None

    def export(self, info: Mapping[str, Any] | None = None, *, full: bool | None = None) -> Path:
        """Writes the next snapshot now and returns its directory, published.

        Args:
            info: JSON-serialisable facts about this moment of training (a step, a data
                position), kept in ``snapshot.json`` and read by the follower.
            full: force a full snapshot (True) or follow ``full_every`` (None). A delta
                cannot be forced: the first snapshot of a run is full.

        Raises:
            TypeError: ``info`` is not a JSON object.
            ValueError: ``full=False``.
        """
        return self._export(info, full, wait=True)

    def flush(self) -> Path | None:
        """Waits until the snapshot being written (if any) is published; returns the newest published, or None.

        Raises:
            RuntimeError: the snapshot failed to be written (from its ``OSError`` or other cause); the
                next one is full.
        """
        if self._writing is not None:
            self._writing.join()
            self._writing = None
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise RuntimeError(f"ServingExporter: writing a snapshot under {str(self.root)!r} failed: {failure}; "
                               f"nothing of it was published and the next snapshot is full; fix: the cause "
                               f"(e.g. free disk space) and export again") from failure
        return self.last

    def close(self) -> None:
        """Waits for the snapshot being written (:meth:`flush`)."""
        self.flush()

    def _export(self, info: Mapping[str, Any] | None, full: bool | None, wait: bool) -> Path:
        if full is False:
            raise ValueError("ServingExporter.export: `full` must be True or None (follow full_every); a delta "
                             "cannot be forced, the first snapshot of a run is full")
        if info is not None and not isinstance(info, Mapping):
            raise TypeError(f"ServingExporter.export: `info` must be a dict (kept as JSON) or None, got "
                            f"{type(info).__name__}")
        self.flush()  # one snapshot in flight at a time, in order
        began_at, began = self._clock(), time.time()
        self._last_began = began_at
        number = self._next
        is_full = bool(full) or self._chain is None or (self.full_every is not None and self._deltas >= self.full_every)
        chain = number if is_full or self._chain is None else self._chain
        self._chain = None  # a failure part way moved some tables' chains: the next snapshot is full
        tables = {name: (module.table.serving_export(not is_full), module.mode)
                  for name, module in self._embeddings.items()}
        dense = _dense_copy(self._dense, self._holders) if self._dense is not None else None
        meta = snapshots.SnapshotMeta(number=number, kind="full" if is_full else "delta", chain=chain,
                                      base=None if is_full else number - 1, began=began,
                                      seconds=self._clock() - began_at, embeddings=tuple(self._embeddings),
                                      dense=DENSE_FILE if dense is not None else None, info=dict(info or {}))
        self._chain, self._next = chain, number + 1  # as if written: a failed write resets the chain
        self._deltas = 0 if is_full else self._deltas + 1
        if wait:
            self._write(number, tables, dense, meta)
            failure, self._failure = self._failure, None
            if failure is not None:
                raise failure  # as it was raised: this call wrote the snapshot
        else:
            self._writing = threading.Thread(target=self._write, args=(number, tables, dense, meta),
                                             name=f"unison-serving-export {number}")
            self._writing.start()  # not a daemon: an exiting process still publishes it
        return snapshots.snapshot_path(self.root, number)

    def _write(self, number: int, tables: dict[str, tuple[dict[str, Any], str | None]],
               dense: dict[str, torch.Tensor] | None, meta: snapshots.SnapshotMeta) -> None:
        """Writes and publishes snapshot ``number`` (on the exporter's thread, or the caller's); a failure is
        kept for :meth:`flush` and leaves nothing published."""
        temporary = snapshots.temporary_path(self.root, number)
        try:
            temporary.mkdir()
            for name, (export, mode) in tables.items():
                write_export(temporary / "embeddings" / name, export, mode)
            if dense is not None:
                _save_dense(dense, temporary / DENSE_FILE)
            snapshots.write_meta(temporary, meta)
            path = snapshots.publish(temporary, self.root, number)
        except BaseException as exc:
            shutil.rmtree(temporary, ignore_errors=True)
            self._chain = None
            self._failure = exc
            return
        self.last = path
        if meta.kind == "full" and self.keep_chains is not None:
            try:
                self._prune()
            except OSError as exc:  # the snapshot is published; older ones stay
                warnings.warn(f"ServingExporter: removing the chains before snapshot {number} under "
                              f"{str(self.root)!r} failed ({exc}); they stay on disk until the next full "
                              f"snapshot prunes again", RuntimeWarning, stacklevel=1)

    def _prune(self) -> None:
        """Removes the snapshots older than the newest ``keep_chains`` chains' full snapshots."""
        assert self.keep_chains is not None
        fulls = [n for n in snapshots.list_snapshots(self.root) if snapshots.read_meta(self.root, n).kind == "full"]
        if len(fulls) <= self.keep_chains:
            return
        oldest_kept = fulls[-self.keep_chains]
        for number in snapshots.list_snapshots(self.root):
            if number < oldest_kept:
                snapshots.remove(self.root, number)

    def __repr__(self) -> str:
        return (f"ServingExporter({str(self.root)!r}, tables={list(self._embeddings)}, every_seconds="
                f"{self.every_seconds}, full_every={self.full_every}, next={self._next})")


def _holders(dense: nn.Module, embeddings: dict[str, DynamicEmbedding]) -> frozenset[int]:
    """The ids of ``dense``'s modules that are tables or hold one (each table must be exported)."""
    exported = {id(module) for module in embeddings.values()}
    holders: set[int] = set()
    for name, module in dense.named_modules():
        if isinstance(module, DynamicEmbedding):
            if id(module) not in exported:
                raise ValueError(f"ServingExporter: `dense` holds a DynamicEmbedding at {name or '(the module)'!r} "
                                 f"that is not in `embeddings` ({sorted(embeddings)}); its rows would be lost to "
                                 f"the server. fix: add it, e.g. embeddings={{{name.split('.')[-1]!r}: "
                                 f"model.{name}}}")
            holders.update(id(m) for _, m in _ancestors(dense, name))
    return frozenset(holders)


def _ancestors(root: nn.Module, name: str) -> list[tuple[str, nn.Module]]:
    """``root`` and each module on the path to its submodule ``name``, that one included."""
    path, module, prefix = [("", root)], root, ""
    for part in name.split(".") if name else []:
        module = module.get_submodule(part)
        prefix = f"{prefix}{part}."
        path.append((prefix, module))
    return path


def _dense_state(module: nn.Module, holders: frozenset[int], prefix: str = "") -> dict[str, torch.Tensor]:
    """``module``'s state_dict without its tables' entries, never asking a table for its state.

    A table's ``state_dict()`` reads every row (from the ps tasks, on ps tasks), so the
    subtrees without a table give their own ``state_dict()`` and the modules that hold one
    give their parameters and persistent buffers, then recurse.
    """
    if id(module) not in holders:
        return dict(module.state_dict(prefix=prefix))
    state: dict[str, torch.Tensor] = {}
    if isinstance(module, DynamicEmbedding):
        return state
    for name, parameter in module._parameters.items():
        if parameter is not None:
            state[prefix + name] = parameter
    for name, buffer in module._buffers.items():
        if buffer is not None and name not in module._non_persistent_buffers_set:
            state[prefix + name] = buffer
    for name, child in module._modules.items():
        if child is not None:
            state.update(_dense_state(child, holders, f"{prefix}{name}."))
    return state


def _dense_copy(dense: nn.Module, holders: frozenset[int]) -> dict[str, torch.Tensor]:
    """``dense``'s state_dict without its tables, copied as plain CPU tensors (training may change it next)."""
    return {key: value.detach().cpu().clone().as_subclass(torch.Tensor)
            for key, value in _dense_state(dense, holders).items() if isinstance(value, torch.Tensor)}


def _save_dense(state: dict[str, torch.Tensor], path: Path) -> None:
    """A dense state (:func:`_dense_copy`), fsynced (``torch.load(weights_only=True)`` reads it)."""
    with open(path, "wb") as handle:
        torch.save(state, handle)
        handle.flush()
        os.fsync(handle.fileno())
