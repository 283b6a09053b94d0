"""What unison changes in PyTorch, each installed once on first use, and the list of them.

unison changes torch's global behaviour in a few places (module registration hooks,
optimizer step hooks, wrapped methods of GradScaler, LR schedulers, AveragedModel and
Optimizer, ``nn.Parameter.__deepcopy__``). Each change is an :class:`Interposition`:
what it is, what it changes, why, and whether it is installed yet. They are installed
on first use (entering a strategy's scope, running a step), never at import, so that
importing unison changes nothing for code that never uses it; ``INTERPOSITIONS`` lists
every one a module defines (``tests/architecture/test_interpositions.py`` checks both).
Per-object changes are not listed here: a module built in a multi-replica scope gets a
``ReplicaParameters`` dict (``values/replica_parameters.py``), and distributed variables
are tensor subclasses (``values/variables.py``).
"""

from __future__ import annotations

import threading
import typing
from typing import Callable

__all__ = ["INTERPOSITIONS", "Interposition"]


@typing.final
class Interposition:
    """One change unison makes to PyTorch: installed once, when first called, and listed.

    Args:
        what: the change, e.g. "global optimizer step pre/post hooks".
        target: what in torch it changes, e.g. "torch.optim.Optimizer (all instances)".
        why: the reason, in a sentence.
        action: installs it.
    """

    def __init__(self, what: str, target: str, why: str, action: Callable[[], None]):
        self.what, self.target, self.why = what, target, why
        self._action = action
        self._lock = threading.Lock()
        self._done = False
        INTERPOSITIONS.append(self)

    @property
    def installed(self) -> bool:
        """Whether it is installed in this process."""
        return self._done

    def __call__(self) -> None:
        """Installs it, the first time (thread-safe); later calls return at once."""
        if self._done:
            return
        with self._lock:
            if not self._done:
                self._action()
                self._done = True

    def __repr__(self) -> str:
        state = "installed" if self.installed else "not installed"
        return f"Interposition({self.what!r} on {self.target}, {state})"


INTERPOSITIONS: list[Interposition] = []
"""Every interposition defined by an imported unison module, in definition order."""
