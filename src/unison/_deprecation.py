"""The paths and names that left unison's public face in 0.2, kept as deprecated aliases until 0.3.

Version 0.2 moved the internal packages under underscored paths (PyTorch's rule: a module
whose dotted path has a segment that starts with ``_`` is private) and kept one public
home per name (``CHANGELOG.md`` lists each move). Code, pickles and ``mock.patch`` targets
that name an old path keep working for one release, with a ``DeprecationWarning`` that
names the replacement:

- **a module path** (:data:`MOVED_MODULES`): ``import unison.collectives.ops.base`` gives
  the module ``unison._collectives.ops.base`` itself, not a copy, so that objects pickled
  by the old path load and a patch through it reaches the code that runs. A finder first
  on ``sys.meta_path`` (:func:`install`, called by ``unison/__init__.py``) maps the old
  names; a module that exists at the old path (a public facade such as
  ``unison.coordinator``, or ``unison.launch.__main__``) is imported as usual.
- **a name that left a public namespace** (:data:`MOVED_NAMES`):
  ``unison.run_distribute_coordinator`` is ``unison.coordinator.run_distribute_coordinator``.
  Each public namespace's ``__getattr__`` (:func:`module_getattr`) serves them, and old
  submodules reached as attributes (``unison.collectives`` after ``import unison``).

Removing the aliases in 0.3 is deleting this module and its two calls.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

__all__ = ["MOVED_MODULES", "MOVED_NAMES", "Moved", "install", "module_getattr", "moved_module"]

#: The release that removes the aliases.
REMOVED_IN = "0.3"


class Moved(NamedTuple):
    """Where an old path or name went, and what a user writes instead."""

    target: str
    """The private module (``unison._cluster``), or ``module:attribute`` for a name."""
    instead: str | None
    """The public replacement, or None where there is none (the thing was plumbing)."""


#: Old module paths, each with everything under it, and where they went.
MOVED_MODULES: dict[str, Moved] = {
    "unison.checkpoint": Moved("unison._checkpoint", "the checkpoint names at top level (unison.save_checkpoint, "
                               "unison.BackupAndRestore, unison.save_step_checkpoint, unison.write_filepath, ...)"),
    "unison.cluster": Moved("unison._cluster", "the cluster names at top level (unison.ClusterSpec, "
                            "unison.TFConfigClusterResolver, unison.detect_cluster_resolver, ...)"),
    "unison.collectives": Moved("unison._collectives", "unison.tensorpack for the gradient-list helpers, and "
                                "unison.CrossDeviceOps, unison.ReductionToOneDevice, ... for the cross-device ops"),
    "unison.coordinator": Moved("unison._coordinator", "the names of unison.coordinator"),
    "unison.embeddings": Moved("unison._embeddings", "unison.DynamicEmbedding and the names of unison.embeddings"),
    "unison.gradient_sync": Moved("unison._gradient_sync", None),
    "unison.input": Moved("unison._input", "the input names at top level (unison.InputContext, "
                          "unison.DistributedDataset, unison.InputOptions, ...)"),
    "unison.interpose": Moved("unison._interpose", None),
    "unison.launch": Moved("unison._launch", "`python -m unison.launch`, the `unison` command or unison.launch.main"),
    "unison.placement": Moved("unison._placement", "the names of unison.placement"),
    "unison.ps": Moved("unison._ps", "the parameter-server names at top level (unison.ParameterServerStrategy, "
                       "unison.ClusterCoordinator, unison.ShardedVariable, unison.Server, ...) and "
                       "unison.partitioners"),
    "unison.strategies": Moved("unison._strategies", "the strategies at top level (unison.MirroredStrategy, "
                               "unison.get_strategy, ...)"),
    "unison.values": Moved("unison._values", "the value and variable names at top level (unison.PerReplica, "
                           "unison.MirroredVariable, unison.VariableAggregation, ...)"),
    "unison.context": Moved("unison._context", "unison.ReplicaContext"),
    "unison.reduce": Moved("unison._reduce", "unison.ReduceOp"),
    "unison.devices": Moved("unison._devices", None),
}


def _names(target: str, instead: str | None, *names: str) -> dict[str, Moved]:
    return {name: Moved(f"{target}:{name}", instead and f"{instead}.{name}") for name in names}


#: Names that left a public namespace: ``MOVED_NAMES[namespace][name]``.
MOVED_NAMES: dict[str, dict[str, Moved]] = {
    "unison": _names("unison.coordinator", "unison.coordinator", "CoordinatorMode", "WorkerContext",
                     "get_current_worker_context", "run_distribute_coordinator", "run_standard_server"),
    "unison.embeddings": _names("unison", "unison", "DynamicEmbedding"),
    "unison.launch": {
        "launch_main": Moved("unison._launch.cli:launch_main", "unison.launch.main(['launch', ...])"),
        **_names("unison._launch", None, "run_local_cluster", "LocalCluster", "Task", "plan_tasks"),
    },
    "unison.placement": {
        **_names("unison._placement.parameter_servers", None, "array_split"),
        **_names("unison._ps.remote_variables.name_placement", None, "ParameterPlacementHook", "PsGroupAssigner"),
    },
}


def moved_module(name: str) -> tuple[str, Moved] | None:
    """The private path of an old module path (and its entry), or None if ``name`` did not move."""
    for old, moved in MOVED_MODULES.items():
        if name == old or name.startswith(f"{old}."):
            return moved.target + name[len(old):], moved
    return None


def _advice(old: str, new: str, instead: str | None, module: bool = False) -> str:
    """The warning's text: what is deprecated, until when, and what to write instead."""
    head = f"{old} is deprecated and will be removed in unison {REMOVED_IN}"
    if instead and not module:
        return f"{head}; use {instead} instead"
    moved = f"{head}: it moved to {new}, which is internal"
    return f"{moved}; use {instead} instead" if instead else f"{moved}, and has no public replacement"


def _machinery(filename: str) -> bool:
    """The import system's frozen frames, which ``warnings`` itself skips when it counts a stacklevel."""
    return "importlib" in filename and "_bootstrap" in filename


def _warn(message: str) -> None:
    """A DeprecationWarning pointing at the user's line, past the import machinery and this module."""
    level, frame = 2, sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename in (__file__, importlib.__file__)
                                 or _machinery(frame.f_code.co_filename)):
        if not _machinery(frame.f_code.co_filename):
            level += 1
        frame = frame.f_back  # type: ignore[assignment]
    warnings.warn(message, DeprecationWarning, stacklevel=level)


class _AliasLoader(importlib.abc.Loader):
    """Loads an old module path as the module at its new one (the same object)."""

    def __init__(self, target: str, message: str):
        self.target, self.message = target, message

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        _warn(self.message)
        module = importlib.import_module(self.target)
        self._real_spec = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run (``create_module`` imported it under its own name); the import system set
        ``__spec__`` to the old path's in between, so the module gets its own back (reloads,
        ``python -m`` and tools read it)."""
        module.__spec__ = self._real_spec


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds the old module paths of :data:`MOVED_MODULES`; first on ``sys.meta_path``."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        found = moved_module(fullname)
        if found is None:
            return None
        parent_name = fullname.rpartition(".")[0]
        parent = sys.modules.get(parent_name)
        if parent is not None and parent.__name__ == parent_name and \
                importlib.machinery.PathFinder.find_spec(fullname, path) is not None:
            return None  # a real module at the old path: a public facade, or unison.launch.__main__
        new, moved = found
        if importlib.util.find_spec(new) is None:
            return None
        message = _advice(fullname, new, moved.instead, module=True)
        return importlib.util.spec_from_loader(fullname, _AliasLoader(new, message))


_FINDER = _MovedModuleFinder()


def install() -> None:
    """Puts the finder of old module paths first on ``sys.meta_path`` (once)."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def _target(moved: Moved) -> Any:
    module, _, attribute = moved.target.partition(":")
    return getattr(importlib.import_module(module), attribute)


def module_getattr(module_name: str,
                   fallback: Callable[[str], Any] | None = None) -> Callable[[str], Any]:
    """A module ``__getattr__`` for a public namespace: its moved names and old submodules, then ``fallback``."""
    names = MOVED_NAMES.get(module_name, {})

    def __getattr__(name: str) -> Any:
        if name in names:
            if sys._getframe(1).f_code.co_name == "_handle_fromlist":
                # `from namespace import name` asks twice (hasattr, then the import): warn on the second
                return _target(names[name])
            moved = names[name]
            module, _, attribute = moved.target.partition(":")
            _warn(_advice(f"{module_name}.{name}", f"{module}.{attribute}", moved.instead))
            return _target(moved)
        if fallback is not None:
            try:
                return fallback(name)
            except AttributeError:
                pass
        if moved_module(f"{module_name}.{name}") is not None:
            try:
                return importlib.import_module(f"{module_name}.{name}")
            except ModuleNotFoundError:
                pass
        raise AttributeError(f"module {module_name!r} has no attribute {name!r}")

    return __getattr__
