"""The round-robin assignment rules of AdaNet's RoundRobinStrategy, as pure functions.

Workers are dealt *tasks* in rounds of ``num_subnetworks + 1``: a worker's task is
``worker_index % (num_subnetworks + 1)``. Task 0 is the ensemble task: that worker builds
the ensemble (and, to do so, every subnetwork) and trains the ensemble's own variables,
not the subnetworks. Task ``t >= 1`` is subnetwork slot ``t - 1`` of its round: in a
full round slot ``s`` trains subnetwork ``s``. A trailing partial round (``num_workers``
not a multiple of the round) has fewer slots than subnetworks; its slots take the
subnetworks modulo their number (``drop_remainder=False``), or only subnetwork ``s``
(``drop_remainder=True``, the rest of that round's subnetworks are left to the full
rounds, and are dropped when there are none). With one subnetwork or one worker every
worker builds and trains everything.

These functions take the cluster as plain integers so they can be checked exhaustively;
:class:`unison.placement.RoundRobinStrategy` answers with them for its configured cluster.

AdaNet equivalent: ``RoundRobinStrategy._worker_task`` and the bodies of its
``should_*`` methods. Difference: :func:`dropped_subnetworks` counts the dropped
subnetworks exactly (AdaNet's warning says ``n - workers - 1`` and is silent when
``n == workers``; the right count is ``n - workers + 1``).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "check_num_subnetworks",
    "check_subnetwork_index",
    "worker_task",
    "builds_ensemble",
    "builds_subnetwork",
    "trains_subnetworks",
    "dropped_subnetworks",
]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_num_subnetworks(num_subnetworks: Any) -> None:
    """Raises ValueError unless ``num_subnetworks`` is an integer >= 1."""
    if not _is_int(num_subnetworks) or num_subnetworks < 1:
        raise ValueError(
            f"num_subnetworks must be an integer >= 1 (the subnetworks of the current iteration), got "
            f"{num_subnetworks!r}; fix `num_subnetworks`"
        )


def check_subnetwork_index(num_subnetworks: int, subnetwork_index: Any) -> None:
    """Raises ValueError unless ``subnetwork_index`` is in ``0..num_subnetworks - 1``."""
    if not _is_int(subnetwork_index) or not 0 <= subnetwork_index < num_subnetworks:
        raise ValueError(
            f"subnetwork_index {subnetwork_index!r} is out of range: the iteration has {num_subnetworks} "
            f"subnetwork(s) (valid 0..{num_subnetworks - 1}); fix `subnetwork_index`"
        )


def worker_task(worker_index: int, num_subnetworks: int) -> int:
    """The worker's task: 0 builds the ensemble, ``t >= 1`` is subnetwork slot ``t - 1``."""
    return worker_index % (num_subnetworks + 1)


def builds_ensemble(num_workers: int, worker_index: int, num_subnetworks: int) -> bool:
    """Whether the worker builds the ensemble: task 0, or everyone with one subnetwork.

    (With one worker, that worker has task 0.)
    """
    if num_subnetworks == 1:
        return True
    return worker_task(worker_index, num_subnetworks) == 0


def _slots_in_round(num_workers: int, worker_index: int, num_subnetworks: int) -> int:
    """Subnetwork slots in the worker's round: ``num_subnetworks``, or fewer in a trailing partial round."""
    round_size = num_subnetworks + 1
    if worker_index < (num_workers // round_size) * round_size:
        return num_subnetworks
    # Only reached when num_workers % round_size > 0: worker_index < num_workers.
    return num_workers % round_size - 1


def builds_subnetwork(
    num_workers: int, worker_index: int, num_subnetworks: int, subnetwork_index: int, drop_remainder: bool
) -> bool:
    """Whether the worker builds subnetwork ``subnetwork_index``.

    The ensemble worker builds all of them (the ensemble needs them); a subnetwork
    worker builds the subnetworks of its slot, which it also trains.
    """
    if num_subnetworks == 1:
        return True
    task = worker_task(worker_index, num_subnetworks)
    if task == 0:
        return True
    slot = task - 1
    if drop_remainder:
        return slot == subnetwork_index
    # A slot in a partial round exists only if the round has more than the ensemble
    # task, so the modulus is >= 1 here.
    return slot == subnetwork_index % _slots_in_round(num_workers, worker_index, num_subnetworks)


def trains_subnetworks(num_workers: int, worker_index: int, num_subnetworks: int) -> bool:
    """Whether the worker trains the subnetworks it builds: every worker but an ensemble worker.

    With one subnetwork or one worker, every worker trains everything.
    """
    if num_subnetworks == 1 or num_workers == 1:
        return True
    return not builds_ensemble(num_workers, worker_index, num_subnetworks)


def dropped_subnetworks(num_workers: int, num_subnetworks: int, drop_remainder: bool) -> range:
    """The subnetworks no worker trains: only with ``drop_remainder`` and fewer than ``n + 1`` workers.

    With ``drop_remainder=True`` subnetwork ``s`` is trained only by workers in slot ``s``,
    and slots ``0..num_workers - 2`` are the only ones dealt when ``num_workers <=
    num_subnetworks``; so ``num_subnetworks - num_workers + 1`` subnetworks are dropped.
    """
    if not drop_remainder or num_workers == 1 or num_subnetworks == 1:
        return range(0)
    return range(min(num_workers - 1, num_subnetworks), num_subnetworks)
