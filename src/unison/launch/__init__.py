"""The ``unison`` command: ``unison launch`` runs a script as every task of a local (or multi-node)
cluster, ``unison server`` runs a standard server.

``python -m unison.launch ARGS`` is ``unison launch ARGS``; ``main(argv)`` is the console
script, for a program that starts the command itself (``main(["launch", "--workers", "2",
"train.py"])`` returns its exit code). The launcher imports no torch. The implementation
is ``unison._launch``.
"""

from unison import _deprecation
from unison._launch.cli import main

__all__ = ["main"]

__getattr__ = _deprecation.module_getattr(__name__)
