"""The kinds of change unison makes to PyTorch: each defined in ``unison._interpose`` and listed.

Every global change unison makes to torch (registration hooks, optimizer step hooks,
wrapped methods of Optimizer, GradScaler, LR schedulers and AveragedModel, a replaced
``nn.Parameter.__deepcopy__``) is an :class:`Interposition`; one made for a ``with`` block
is a :class:`ScopedInterposition`; one made to a user's object (an optimizer's own
``zero_grad``, a module's parameter dict) is an :class:`InstanceInterposition`. Each says
what it is, what in torch it changes, why, and whether it is in effect. The behaviour a
hook runs stays with the package that owns it (the gradient synchroniser's step hooks,
the ps optimizer-state wrappers), which hands its handlers to the interposition when it
first needs it. Installed on first use, never at import: importing unison changes
nothing for code that never uses it. ``every_change.INTERPOSITIONS`` lists them all, as
a literal tuple (``tests/architecture/test_interpositions.py``).
"""

from __future__ import annotations

import contextlib
import threading
import typing
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["Interposition", "ScopedInterposition", "InstanceInterposition"]


@typing.final
class Interposition:
    """One change unison makes to PyTorch: installed once, when first called, and listed.

    Args:
        what: the change, e.g. "global optimizer step pre/post hooks".
        target: what in torch it changes, e.g. "torch.optim.Optimizer (all instances)".
        why: the reason, in a sentence.
        action: installs it, given the owner's handlers as keyword arguments.
    """

    def __init__(self, what: str, target: str, why: str, action: Callable[..., None]):
        self.what, self.target, self.why = what, target, why
        self._action = action
        self._lock = threading.Lock()
        self._done = False
        self._handlers: dict[str, Callable[..., Any]] = {}

    @property
    def installed(self) -> bool:
        """Whether it is installed in this process."""
        return self._done

    def __call__(self, **handlers: Callable[..., Any]) -> None:
        """Installs it, the first time (thread-safe), with the owner's ``handlers`` (the
        behaviour its hooks run); later calls return at once. Handlers differ from the
        installed ones only through a bug (two owners of one change): that raises."""
        if self._done:
            if handlers != self._handlers:
                raise RuntimeError(f"{self!r} is installed with handlers {self._handlers}, not {handlers}")
            return
        with self._lock:
            if not self._done:
                self._action(**handlers)
                self._handlers = handlers
                self._done = True

    def __repr__(self) -> str:
        state = "installed" if self.installed else "not installed"
        return f"Interposition({self.what!r} on {self.target}, {state})"


@typing.final
class ScopedInterposition:
    """A change unison makes to PyTorch for the length of a ``with`` block, and listed.

    A torch-function mode pushed while a scope creates variables, global hooks that watch
    a block's module registrations: active while some thread is inside, gone after.

    Args:
        what, target, why: as for :class:`Interposition`.
        context: makes the change, given the owner's handlers, for a ``with`` block.
    """

    def __init__(
        self, what: str, target: str, why: str, context: Callable[..., contextlib.AbstractContextManager[Any]]
    ):
        self.what, self.target, self.why = what, target, why
        self._context = context
        self._lock = threading.Lock()
        self._active = 0

    @property
    def installed(self) -> bool:
        """Whether some thread of this process is inside it now."""
        return self._active > 0

    @contextlib.contextmanager
    def __call__(self, **handlers: Callable[..., Any]) -> Iterator[None]:
        """Makes the change for the ``with`` block, with the owner's ``handlers``."""
        with self._context(**handlers):
            with self._lock:
                self._active += 1
            try:
                yield
            finally:
                with self._lock:
                    self._active -= 1

    def __repr__(self) -> str:
        state = "active" if self.installed else "not active"
        return f"ScopedInterposition({self.what!r} on {self.target}, {state})"


@typing.final
class InstanceInterposition:
    """A change unison makes to one object of the user's (an optimizer, a module), and listed.

    The class stays as torch made it; the change lives on the instance that the owner
    hands over, so other instances of the class are untouched.

    Args:
        what, target, why: as for :class:`Interposition`.
        action: makes the change, given the instance and the owner's handlers.
    """

    def __init__(self, what: str, target: str, why: str, action: Callable[..., None]):
        self.what, self.target, self.why = what, target, why
        self._action = action
        self._count = 0

    @property
    def installed(self) -> bool:
        """Whether it was made to some instance in this process."""
        return self._count > 0

    @property
    def instances(self) -> int:
        """How many instances it was made to in this process (diagnostics)."""
        return self._count

    def __call__(self, instance: Any, **handlers: Any) -> None:
        """Makes the change to ``instance``, with the owner's ``handlers``."""
        self._action(instance, **handlers)
        self._count += 1

    def __repr__(self) -> str:
        return f"InstanceInterposition({self.what!r} on {self.target}, made to {self._count} instances)"
