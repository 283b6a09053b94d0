"""The replica synchroniser: the replica threads of one worker merge their gradients, then each steps its own copy.

- ``replica_sync``: ``ReplicaGradientSync``, the ``GradientSync`` contract: when the
  replicas merge (a backward pass ends, or a step begins), ``no_sync``, each replica's
  per-step state;
- ``replica_merge``: ``ReplicaGradientMerge``, the merge itself: every replica's
  gradients gathered, reduced (in place, the ops' ``in_place_reduction``, from flat buffers,
  ``replica_grad_buffers``, or through the CrossDeviceOps) and written back;
- ``replica_optimizers``: ``ReplicaOptimizers``, which optimizer steps each replica's
  components: replica 0 with the user's state (``first_replica_optimizer``), the others
  with shadow copies (``shadow_optimizers``); ``replica_zero_grad``: their
  ``zero_grad`` without a dispatch per parameter.
"""

from unison._gradient_sync.replicas.replica_merge import ReplicaGradientMerge
from unison._gradient_sync.replicas.replica_optimizers import ReplicaOptimizers
from unison._gradient_sync.replicas.replica_sync import ReplicaGradientSync, ReplicaMeeting

__all__ = ["ReplicaGradientMerge", "ReplicaGradientSync", "ReplicaMeeting", "ReplicaOptimizers"]
