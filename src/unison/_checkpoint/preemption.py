"""PreemptionCheckpointHandler: a SIGTERM to any worker makes every worker save at the same step.

Schedulers (SLURM, Kubernetes, cloud spot instances) send SIGTERM some seconds before
they kill a task. The handler catches it; the worker that got it proposes, through the
worker group's store, to stop after its next step (the first proposal wins, with
``compare_set``), and every worker looks for it after each ``run`` call (one store
lookup, not a collective). In synchronous training no worker can finish that step
before the proposer has taken part in it, so every worker sees the proposal before it
has passed the step: all of them stop there, save — model, optimizer and the other state, the number of
``run`` calls, every worker's random generators — and leave through ``exit_fn``: by
default exit code ``PREEMPTED_EXIT_CODE``, which ``unison launch --max-restarts``
reports as a preemption and restarts. The restarted job restores the save on creation
and ``total_run_calls`` continues from it.

A worker that gets the signal also leaves a file naming itself in the directory
``UNISON_PREEMPTION_NOTICES`` (set by ``unison launch``), so the launcher's message names
the task(s) the notice went to rather than whichever task exits first.

Without a store (a torchrun group unison did not form) the workers agree with one tiny
all-reduce per ``run`` call instead. In one process (local strategies) the signal
simply stops after the current step.

tf.distribute equivalent: ``tf.distribute.experimental.PreemptionCheckpointHandler`` and
``TerminationConfig``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
import threading
import typing
from collections.abc import Callable, Iterator, Mapping
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
from unison._cluster.env import PREEMPTED_EXIT_CODE, UNISON_PREEMPTION_NOTICES
from unison._collectives.ops.collective import CollectiveAllReduce
from unison.errors import PeerLostError

__all__ = ["PreemptionCheckpointHandler", "TerminationConfig", "PREEMPTED_EXIT_CODE"]


_CHECKPOINT = "preemption.pt"


def _exit_for_restart() -> None:
    sys.exit(PREEMPTED_EXIT_CODE)


@dataclasses.dataclass(frozen=True)
class TerminationConfig:
    """How a preempted job saves and leaves (``tf.distribute.experimental.TerminationConfig``).

    Attributes:
        grace_period: seconds the scheduler leaves between its signal and the kill; only
            reported (a step longer than it cannot be waited for).
        exit_fn: called after the save (default: exit with ``PREEMPTED_EXIT_CODE``).
        save_fn: replaces the handler's own save (called on every worker, at the agreed step).
        signals: the signals that mean "you are being preempted" (default SIGTERM).
    """

    grace_period: float = 0.0
    exit_fn: Callable[[], Any] | None = None
    save_fn: Callable[[], Any] | None = None
    signals: tuple[int, ...] = (signal.SIGTERM,)

    def __post_init__(self) -> None:
        if (
            isinstance(self.grace_period, bool)
            or not isinstance(self.grace_period, (int, float))
            or self.grace_period < 0
        ):
            raise ValueError(f"TerminationConfig.grace_period must be >= 0 seconds, got {self.grace_period!r}")
        for name in ("exit_fn", "save_fn"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise TypeError(f"TerminationConfig.{name} must be callable or None, got {value!r}")


@typing.final
class PreemptionCheckpointHandler:
    """Saves every worker at the same step when any of them is told to stop, and resumes there.

    Args:
        strategy: the strategy training runs under.
        checkpoint_dir: where the save lives (visible to every worker).
        state: name -> object with ``state_dict()``/``load_state_dict()``.
        termination_config: see :class:`TerminationConfig`.

    Raises:
        ValueError / TypeError: for an empty or unusable ``state``.
        CheckpointError: if the save found cannot be restored into ``state``.
    """

    def __init__(self, strategy: Any, checkpoint_dir: str | os.PathLike[str], state: Mapping[str, Any],
                 termination_config: TerminationConfig | None = None):
        self._state = check_state(state)
        self._strategy = strategy
        self._dir = Path(checkpoint_dir)
        self._config = termination_config or TerminationConfig()
        components = strategy.extended.components
        self._rank, self._workers = components.worker_index, components.num_workers
        self._attempt = components.cluster.restart_count
        self._task_name = components.cluster.task_name
        self._calls = 0
        self._signalled = threading.Event()  # this worker got a preemption signal
        self._target: int | None = None  # the run call after which every worker saves and leaves
        self._lock = threading.Lock()
        self._store = self._find_store(components)
        self._restore()
        for signum in self._config.signals:
            signal.signal(signum, self._on_signal)

    @property
    def total_run_calls(self) -> int:
        """``run`` calls made so far, restarts included (restored from the save)."""
        return self._calls

    # -- the step ---------------------------------------------------------------------
    def run(self, step_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Calls ``step_fn(*args, **kwargs)``, counts it, and saves and leaves at the agreed step."""
        result = step_fn(*args, **kwargs)
        self._calls += 1
        if self._signalled.is_set():
            self._propose(self._calls + 1)
        if self._target is None and self._workers > 1:
            self._look_for_proposal()
        target = self._target
        if target is not None and self._calls >= target:
            self._save_and_exit()
        return result

    @contextlib.contextmanager
    def watch_preemption_scope(self) -> Iterator[None]:
        """Turns a peer lost to a preemption into a clean exit (``exit_fn``) instead of a traceback.

        A peer that was killed before it reached the agreed step (its grace period was
        too short) makes the others' next collective fail; inside this scope that ends
        the worker through ``exit_fn`` when a preemption was announced, so the launcher
        restarts from the last save. Other errors pass through.
        """
        try:
            yield
        except PeerLostError:
            if self._target is None and not self._signalled.is_set():
                raise
            (self._config.exit_fn or _exit_for_restart)()

    # -- agreement ---------------------------------------------------------------------
    def _on_signal(self, signum: int, frame: Any) -> None:
        if not self._signalled.is_set():
            self._leave_notice(signum)
        self._signalled.set()  # everything else happens at the next run call, outside the handler
        if self._workers == 1:
            self._set_target(self._calls + 1)

    def _leave_notice(self, signum: int) -> None:
        """Tells ``unison launch`` that this task got the notice (a file named after it).

        Written at once, before any proposal: no task can exit at the agreed step before
        this task proposed it, so the launcher finds the file whichever task exits first.
        """
        notices = os.environ.get(UNISON_PREEMPTION_NOTICES)
        if not notices:
            return  # not under unison launch: nobody reads it
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        try:
            path = Path(notices) / self._task_name.replace(":", "-")
            path.write_text(f"{self._task_name} {name}\n", encoding="utf-8")
        except OSError:
            pass  # the directory went away: the launcher then names the first task to exit, as before

    def _key(self) -> str:
        return f"unison-preemption/{self._attempt}/stop-after"

    def _propose(self, target: int) -> None:
        if self._workers == 1 or self._store is None:
            self._set_target(target)
            return
        if self._target is None:
            agreed = self._store.compare_set(self._key(), "", str(target))  # the first proposal wins
            self._set_target(int(agreed))

    def _set_target(self, target: int) -> None:
        with self._lock:
            if self._target is None:
                self._target = target

    def _look_for_proposal(self) -> None:
        if self._store is None:
            self._agree_by_collective()
        elif self._store.check([self._key()]):
            self._set_target(int(self._store.get(self._key())))

    def _agree_by_collective(self) -> None:
        flag = torch.tensor(float(self._calls + 1 if self._signalled.is_set() else 0))
        proposed = int(self._strategy.reduce("max", flag).item())
        if proposed:
            self._set_target(proposed)

    @staticmethod
    def _find_store(components: Any) -> Any:
        if components.num_workers <= 1 or not isinstance(components.cross_device_ops, CollectiveAllReduce):
            return None
        return components.cross_device_ops.worker_group.store

    # -- saving and restoring ---------------------------------------------------------------
    def _save_and_exit(self) -> None:
        if self._config.save_fn is not None:
            self._config.save_fn()
        else:
            self.save()
        (self._config.exit_fn or _exit_for_restart)()

    def save(self) -> None:
        """Saves now (every worker, at the same call count: it is collective)."""
        calls = self._calls
        collective_save(self._dir, _CHECKPOINT, calls, self._rank, {"rng": capture_generators()},
                        lambda: {"calls": calls, "workers": self._workers,
                                 "state": {k: v.state_dict() for k, v in self._state.items()}},
                        self._barrier)

    def _restore(self) -> None:
        saved = load_main(self._dir, _CHECKPOINT, self._state, self._workers)
        if saved is None:
            return
        self._calls = saved["calls"]
        rng_path = generator_file(self._dir, self._calls, self._rank)
        if rng_path.is_file():
            restore_generators(torch.load(rng_path, map_location="cpu", weights_only=False)["rng"])

    def _barrier(self) -> None:
        if self._workers > 1:
            self._strategy.reduce("sum", torch.zeros(()))

    def __repr__(self) -> str:
        return f"PreemptionCheckpointHandler({str(self._dir)!r}, total_run_calls={self._calls})"
