"""What BackupAndRestore and PreemptionCheckpointHandler share: state checks, generators, and a collective save.

A save every worker takes part in: each writes its own generators' file for the step,
all meet, the chief writes the main file (atomically), all meet again, and each drops
its older generator files. A kill at any point leaves a main file whose step has every
worker's generator file beside it.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from unison._checkpoint.files import atomic_save
from unison._checkpoint.table_saves import delta_saving_modules, leaving_tables_out, load_table_chain
from unison.errors import CheckpointError

__all__ = ["check_state", "capture_generators", "restore_generators", "collective_save", "load_main", "generator_file"]


def check_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` as a dict, after checking every entry has ``state_dict``/``load_state_dict``.

    Raises:
        ValueError: if it is empty.
        TypeError: naming an entry without the two methods.
    """
    if not state:
        raise ValueError("state must name at least one object to save, e.g. {'model': model, 'optimizer': opt}")
    for name, item in state.items():
        if not (callable(getattr(item, "state_dict", None)) and callable(getattr(item, "load_state_dict", None))):
            raise TypeError(f"state[{name!r}] is a {type(item).__name__}, which has no state_dict() and "
                            f"load_state_dict(); pass modules, optimizers, schedulers or your own such objects")
    return dict(state)


def capture_generators() -> dict[str, Any]:
    """This process's random generators: torch's, Python's and NumPy's (when installed)."""
    captured: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy is optional
        return captured
    captured["numpy"] = numpy.random.get_state()
    return captured


def restore_generators(captured: Mapping[str, Any]) -> None:
    """Puts back what :func:`capture_generators` returned."""
    torch.set_rng_state(captured["torch"])
    random.setstate(captured["python"])
    if "numpy" in captured:
        import numpy

        numpy.random.set_state(captured["numpy"])


def generator_file(directory: Path, step: int, rank: int) -> Path:
    return directory / f"rng-{step}-w{rank}.pt"


def collective_save(directory: Path, main_name: str, step: int, rank: int, generators: Mapping[str, Any],
                    main: Callable[[], Mapping[str, Any]], barrier: Callable[[], None]) -> None:
    """Saves one step on every worker: generators, barrier, the chief's ``main()``, barrier, clean-up."""
    atomic_save({"step": step, **generators}, generator_file(directory, step, rank))
    barrier()
    if rank == 0:
        atomic_save(dict(main()), directory / main_name)
    barrier()
    keep = generator_file(directory, step, rank).name
    for path in directory.glob(f"rng-*-w{rank}.pt"):
        if path.name != keep:
            path.unlink(missing_ok=True)


def load_main(directory: Path, main_name: str, state: Mapping[str, Any], workers: int) -> dict[str, Any] | None:
    """The main file restored into ``state`` (None when there is none).

    Raises:
        CheckpointError: if it was written by another number of workers or lacks a state name.
    """
    path = directory / main_name
    if not path.is_file():
        return None
    saved = torch.load(path, map_location="cpu", weights_only=False)
    if saved.get("workers") != workers:
        raise CheckpointError(
            f"the save in {str(directory)!r} was written by {saved.get('workers')} workers, but this job has "
            f"{workers}: its data positions and generators do not carry over; restart with the same number of "
            f"workers, or delete it to start over"
        )
    missing = sorted(set(state) - set(saved["state"]))
    if missing:
        raise CheckpointError(f"the save in {str(directory)!r} has no state for {missing}; it holds "
                              f"{sorted(saved['state'])}; pass the same state names as the run that wrote it")
    chain = saved.get("tables")  # tables saved apart, as a full save point and its deltas
    with leaving_tables_out() if chain else contextlib.nullcontext():
        for name, item in state.items():
            item.load_state_dict(saved["state"][name])
    if chain:
        load_table_chain(directory, chain, delta_saving_modules(state))
    return saved
