"""unison: tf.distribute-style distribution strategies for PyTorch, on torch.distributed.

The same training step runs on one device (OneDeviceStrategy), on several devices of
one machine (MirroredStrategy, CentralStorageStrategy) and on a cluster
(MultiWorkerMirroredStrategy). See README.md for a tour.

The public names are listed, with their types, in ``__init__.pyi``; each is imported on
first use (``lazy_loader``, as SciPy and scikit-image do). So ``import unison`` costs
nothing, and a process that never touches a strategy, such as the ``unison launch``
launcher, never imports torch (seconds of CPU and hundreds of MB per process:
``benchmarks/RESULTS.md``, 'Lazy import of unison'). Set
``EAGER_IMPORT=1`` to import everything at once (lazy_loader's switch).

Public by PyTorch's rule: a module whose dotted path has no segment that starts with
``_`` (``unison``, ``unison.coordinator``, ``unison.embeddings``, ``unison.errors``,
``unison.launch``, ``unison.partitioners``, ``unison.placement``, ``unison.tensorpack``).
The paths and names that 0.2 made private still work until 0.3, with a
``DeprecationWarning`` naming the replacement (``unison._deprecation``, ``CHANGELOG.md``).
"""

import lazy_loader as _lazy

from unison import _deprecation

_stub_getattr, __dir__, __all__ = _lazy.attach_stub(__name__, __file__)
__getattr__ = _deprecation.module_getattr(__name__, _stub_getattr)
_deprecation.install()
__version__ = "0.1.0"
