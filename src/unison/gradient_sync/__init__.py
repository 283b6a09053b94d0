"""Gradient synchronisation: the one home of everything that makes ``backward(); opt.step()`` distributed.

- ``replica_merge``: several replica threads of one worker merge their gradients when
  backward ends (and across workers, through the strategy's CrossDeviceOps);
- ``buckets``: one replica per worker, gradients all-reduced in buckets from autograd
  hooks while backward runs (DDP's and Horovod's mechanism), moved by the bucket transport
  its cross-worker transport names (``collectives/bucket_transports.py``);
  ``bucket_gradients``: how gradients get into a bucket and the sums back out;
- ``step_hooks``: the optimizer step hooks through which ``opt.step()`` finds and
  completes its model's synchronisation.

Each synchroniser owns its per-step state and implements the ``GradientSync`` contract
of ``unison.strategies.components``.
"""

from unison.gradient_sync.buckets import DEFAULT_BUCKET_BYTES, BucketedGradientSync
from unison.gradient_sync.replica_merge import ReplicaGradientSync
from unison.gradient_sync.step_hooks import attach, install_step_hooks, sync_of

__all__ = [
    "BucketedGradientSync",
    "ReplicaGradientSync",
    "DEFAULT_BUCKET_BYTES",
    "attach",
    "install_step_hooks",
    "sync_of",
]
