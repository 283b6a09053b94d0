"""The distribute coordinator: a worker function on every task of a cluster, and the standard servers.

``run_distribute_coordinator(worker_fn, strategy, eval_fn=None, ..., mode=...)`` works in
both modes of TensorFlow's coordinator. ``CoordinatorMode.INDEPENDENT_WORKER``: every task
runs it; workers join the process group and run ``worker_fn``, ps tasks serve, the
evaluator runs ``eval_fn``. ``CoordinatorMode.STANDALONE_CLIENT``: a client sends
``worker_fn`` to the standard servers (``run_standard_server``, ``StandardServer``,
``stop_standard_servers``) started on every task and collects the results. Inside
``worker_fn``, ``get_current_worker_context()`` is the task's ``WorkerContext``. The
servers' control channel is authenticated with the cluster's key: ``generate_authkey``
makes one, ``read_authkey`` reads the job's (``UNISON_AUTHKEY`` or ``UNISON_AUTHKEY_FILE``).

tf.distribute equivalent: ``distribute_coordinator`` and ``distribute_coordinator_context``.

Each name is imported on first use (names and types in ``__init__.pyi``), so importing
this package imports no torch. The implementation is ``unison._coordinator``.
"""

from unison import _deprecation, _facades

_stub_getattr, __dir__, __all__ = _facades.attach_stub(__name__, __file__)
__getattr__ = _deprecation.module_getattr(__name__, _stub_getattr)
