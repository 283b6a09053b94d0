"""The distribute coordinator: worker contexts, standard servers, and the control channel.

tf.distribute equivalent: ``distribute_coordinator`` and ``distribute_coordinator_context``.

Each name is imported on first use (``lazy_loader``; the names and their types are in
``__init__.pyi``), so that the launcher can read what it needs from this package without
importing torch.
"""

import lazy_loader as _lazy

__getattr__, __dir__, __all__ = _lazy.attach_stub(__name__, __file__)
