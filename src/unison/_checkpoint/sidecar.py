"""SidecarEvaluator: the evaluator task evaluates every checkpoint the chief writes, beside training.

The chief saves checkpoints named by their step (``ckpt-<step>.pt``, with
:func:`save_step_checkpoint`) into a directory; a BackupAndRestore backup there counts
too. The evaluator task (``unison launch --evaluator``) polls the directory, loads each
new checkpoint into its own copy of the model in step order, evaluates it, logs one
line, and stops after ``max_evaluations`` or once it evaluated the checkpoint the chief
marked final (:func:`mark_final`).

tf.distribute equivalent: ``tf.keras.utils.SidecarEvaluator`` (TensorFlow watches its
checkpoint manager's files the same way).
"""

from __future__ import annotations

import logging
import os
import re
import time
import typing
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from unison._checkpoint.files import atomic_save
from unison._strategies.current import get_strategy

__all__ = ["SidecarEvaluator", "save_step_checkpoint", "mark_final"]

logger = logging.getLogger(__name__)

_STEP_FILE = re.compile(r"^ckpt-(\d+)\.pt$")
_FINAL = "FINAL"
_BACKUP = "backup.pt"


def save_step_checkpoint(state: Mapping[str, Any], checkpoint_dir: str | os.PathLike[str], step: int,
                         strategy: Any = None) -> bool:
    """Saves ``state`` (with a ``"model"`` state dict) as ``<dir>/ckpt-<step>.pt`` on the chief, atomically.

    Returns:
        True on the chief (which wrote it), False elsewhere.
    """
    strategy = strategy if strategy is not None else get_strategy()
    if not strategy.extended.should_checkpoint:
        return False
    atomic_save({**state, "step": int(step)}, Path(checkpoint_dir) / f"ckpt-{int(step)}.pt")
    return True


def mark_final(checkpoint_dir: str | os.PathLike[str], step: int, strategy: Any = None) -> bool:
    """Tells the sidecar evaluator that ``step`` is the last checkpoint (on the chief).

    Returns:
        True on the chief (which wrote the mark), False elsewhere.
    """
    strategy = strategy if strategy is not None else get_strategy()
    if not strategy.extended.should_checkpoint:
        return False
    atomic_save({"step": int(step)}, Path(checkpoint_dir) / _FINAL)
    return True


def classification_metrics(model: nn.Module, data: Iterable[Any], steps: int | None = None) -> dict[str, float]:
    """Mean cross-entropy loss and accuracy of ``model`` over ``(inputs, labels)`` batches."""
    loss = correct = count = 0.0
    model.eval()
    with torch.no_grad():
        for index, (inputs, labels) in enumerate(data):
            if steps is not None and index >= steps:
                break
            logits = model(inputs)
            loss += nn.functional.cross_entropy(logits, labels, reduction="sum").item()
            correct += (logits.argmax(dim=1) == labels).sum().item()
            count += labels.numel()
    if not count:
        raise ValueError("SidecarEvaluator: the evaluation data yielded no examples; pass a non-empty dataset")
    return {"loss": loss / count, "accuracy": correct / count}


@typing.final
class SidecarEvaluator:
    """Evaluates each new checkpoint in a directory, in step order.

    Args:
        model: the module to load each checkpoint's ``"model"`` state dict into.
        data: the evaluation data (an iterable of ``(inputs, labels)`` batches by default).
        checkpoint_dir: where the chief writes ``ckpt-<step>.pt`` (and the FINAL mark).
        eval_fn: ``eval_fn(model, data) -> dict`` of metrics; default mean loss and accuracy.
        steps: batches of ``data`` per evaluation for the default ``eval_fn`` (None: all).
        max_evaluations: stop after this many (None: at the checkpoint marked final).
        poll_seconds: how often to look for new checkpoints.

    Raises:
        TypeError: if ``model`` is not a module or ``eval_fn`` not callable.
        ValueError: for a non-positive ``max_evaluations``/``steps``/``poll_seconds``.
    """

    def __init__(self, model: nn.Module, data: Iterable[Any], checkpoint_dir: str | os.PathLike[str],
                 eval_fn: Callable[[nn.Module, Iterable[Any]], Mapping[str, float]] | None = None,
                 steps: int | None = None, max_evaluations: int | None = None, poll_seconds: float = 0.2):
        if not isinstance(model, nn.Module):
            raise TypeError(f"SidecarEvaluator needs an nn.Module to load checkpoints into, got {type(model).__name__}")
        if eval_fn is not None and not callable(eval_fn):
            raise TypeError(f"eval_fn must be callable (model, data) -> dict, got {eval_fn!r}")
        for name, value in (("steps", steps), ("max_evaluations", max_evaluations)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if not poll_seconds > 0:
            raise ValueError(f"poll_seconds must be > 0, got {poll_seconds!r}")
        self._model = model
        self._data = data
        self._dir = Path(checkpoint_dir)
        self._eval_fn = eval_fn or (lambda m, d: classification_metrics(m, d, steps))
        self._max = max_evaluations
        self._poll = poll_seconds
        self._seen: set[int] = set()
        self._backup_stamp: tuple[int, int | None] = (-1, None)

    def start(self) -> dict[int, dict[str, float]]:
        """Evaluates checkpoints as they come until the final one (or ``max_evaluations``); returns metrics by step."""
        results: dict[int, dict[str, float]] = {}
        while True:
            # The mark is read first: the chief writes it after its last checkpoint, so a
            # listing made after seeing it holds every checkpoint there will be.
            final = self._final_step()
            for step, path in self._new_checkpoints():
                results[step] = self._evaluate(step, path)
                if self._max is not None and len(results) >= self._max:
                    return results
            if final is not None:
                return results
            time.sleep(self._poll)

    def _new_checkpoints(self) -> list[tuple[int, Path]]:
        found = []
        try:
            names = os.listdir(self._dir)
        except FileNotFoundError:
            return []
        for name in names:
            match = _STEP_FILE.match(name)
            if match and int(match.group(1)) not in self._seen:
                found.append((int(match.group(1)), self._dir / name))
        if _BACKUP in names:
            step = self._backup_step()
            if step is not None and step not in self._seen and all(step != s for s, _ in found):
                found.append((step, self._dir / _BACKUP))
        return sorted(found)

    def _backup_step(self) -> int | None:
        path = self._dir / _BACKUP
        try:
            stamp = path.stat().st_mtime_ns
            if stamp != self._backup_stamp[0]:
                self._backup_stamp = (stamp, int(torch.load(path, map_location="cpu", weights_only=False)["step"]))
        except (OSError, KeyError, RuntimeError, EOFError):
            return None  # replaced while we read it: the next poll sees the new one
        return self._backup_stamp[1]

    def _final_step(self) -> int | None:
        try:
            return int(torch.load(self._dir / _FINAL, map_location="cpu", weights_only=False)["step"])
        except (OSError, RuntimeError, EOFError):
            return None

    def _evaluate(self, step: int, path: Path) -> dict[str, float]:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
        state = checkpoint.get("model", checkpoint.get("state", {}).get("model"))
        if state is None:
            raise ValueError(f"checkpoint {str(path)!r} has no 'model' state dict; save it as {{'model': "
                             f"model.state_dict(), ...}}")
        self._model.load_state_dict(state)
        metrics = dict(self._eval_fn(self._model, self._data))
        self._seen.add(step)
        line = ", ".join(f"{name} {value:.4f}" for name, value in metrics.items())
        print(f"evaluator: step {step}: {line}", flush=True)
        logger.info("evaluated step %d: %s", step, line)
        return metrics
