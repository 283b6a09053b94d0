"""Gradient synchronisation: the one home of everything that makes ``backward(); opt.step()`` distributed.

Two synchronisers, one subpackage each, and the pieces they share at the top:

- ``replicas/``: several replica threads of one worker merge their gradients when
  backward ends (and across workers, through the strategy's CrossDeviceOps), then each
  replica steps its own optimizer (``ReplicaGradientSync``, ``replicas/replica_sync.py``);
- ``bucketed/``: one replica per worker, gradients all-reduced in buckets from autograd
  hooks while backward runs (DDP's and Horovod's mechanism), moved by the bucket transport
  its cross-worker transport names (``_collectives/transport/bucket_transports.py``)
  (``BucketedGradientSync``, ``bucketed/buckets.py``);
- shared: ``step_hooks`` (the optimizer step hooks through which ``opt.step()`` finds and
  completes its model's synchronisation), ``grad_access`` (reading and setting many
  gradients at once), ``grads_as_buffer_views`` (gradients that live in flat per-dtype
  buffers), ``waiting_parameters`` (frozen or late parameters kept aside until used).

Each synchroniser owns its per-step state and implements the ``GradientSync`` contract
of ``unison._strategies.components``.
"""

from unison._gradient_sync.bucketed.buckets import DEFAULT_BUCKET_BYTES, BucketedGradientSync
from unison._gradient_sync.replicas.replica_sync import ReplicaGradientSync
from unison._gradient_sync.step_hooks import attach, install_step_hooks, sync_of

__all__ = [
    "BucketedGradientSync",
    "ReplicaGradientSync",
    "DEFAULT_BUCKET_BYTES",
    "attach",
    "install_step_hooks",
    "sync_of",
]
