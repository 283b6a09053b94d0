"""What an input pipeline knows about its place in the cluster, and how input is distributed.

``InputContext`` is handed to the user's ``dataset_fn`` by
``distribute_datasets_from_function`` so that the function can shard and batch its own
data. ``InputOptions`` tunes how ``experimental_distribute_dataset`` and
``distribute_datasets_from_function`` deliver batches; ``AutoShardPolicy`` picks how a
dataset is split between workers.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import TypeVar

from unison._input._checks import require_int

__all__ = ["InputContext", "InputOptions", "AutoShardPolicy", "InputReplicationMode", "ValueContext"]

_E = TypeVar("_E", bound=enum.Enum)


class InputReplicationMode(enum.Enum):
    """How many input pipelines ``distribute_datasets_from_function`` builds on a worker.

    ``PER_WORKER``: one pipeline per worker; its batches are dealt to the local replicas
    in turn. ``PER_REPLICA``: one pipeline per replica, each feeding its own replica.

    Equivalent: ``tf.distribute.InputReplicationMode``.
    """

    PER_WORKER = "per_worker"
    PER_REPLICA = "per_replica"


class AutoShardPolicy(enum.Enum):
    """How ``experimental_distribute_dataset`` splits a dataset between workers.

    * ``AUTO``: ``FILE`` when the dataset exposes enough files (see
      :mod:`unison._input.sharding`), else ``DATA``.
    * ``DATA``: every worker reads the whole stream of global batches and keeps its
      rows of each one, so a step consumes exactly one global batch across the cluster.
    * ``FILE``: worker ``w`` reads files ``w, w + W, ...`` only; each of its global-size
      batches is cut into ``W`` steps so that the per-replica batch size matches ``DATA``.
    * ``OFF``: no sharding: every worker reads all data (cut into steps as for ``FILE``).

    Equivalent: ``tf.data.experimental.AutoShardPolicy`` (no ``HINT``). TensorFlow sets
    it on the dataset's options; unison has no dataset options, so it lives on
    :class:`InputOptions`.
    """

    AUTO = "auto"
    DATA = "data"
    FILE = "file"
    OFF = "off"


def _coerce_enum(field: str, value: object, enum_type: type[_E]) -> _E:
    if isinstance(value, enum_type):
        return value
    if isinstance(value, str):
        for member in enum_type:
            if value.strip().lower() in (member.name.lower(), str(member.value)):
                return member
    valid = ", ".join(member.name for member in enum_type)
    raise ValueError(
        f"`{field}` must be an {enum_type.__name__} member or one of its names ({valid}), got {value!r}"
    )


class ValueContext:
    """Which replica a value is made for: what ``experimental_distribute_values_from_function`` passes.

    Equivalent: ``tf.distribute.experimental.ValueContext``; unison also checks the arguments.

    Args:
        replica_id_in_sync_group: the replica's id among all replicas of all workers.
        num_replicas_in_sync: replicas that take part in one step, all workers together.

    Raises:
        TypeError: if an argument is not an int.
        ValueError: if the count is below 1 or the id is out of range.

    Example:
        >>> ValueContext(replica_id_in_sync_group=1, num_replicas_in_sync=2)
        ValueContext(replica_id_in_sync_group=1, num_replicas_in_sync=2)
    """

    __slots__ = ("_replica_id_in_sync_group", "_num_replicas_in_sync")

    def __init__(self, replica_id_in_sync_group: int = 0, num_replicas_in_sync: int = 1):
        self._replica_id_in_sync_group = require_int("replica_id_in_sync_group", replica_id_in_sync_group, minimum=0)
        self._num_replicas_in_sync = require_int("num_replicas_in_sync", num_replicas_in_sync, minimum=1)
        if replica_id_in_sync_group >= num_replicas_in_sync:
            raise ValueError(
                f"`replica_id_in_sync_group` {replica_id_in_sync_group!r} is out of range: there are "
                f"{num_replicas_in_sync} replicas in sync (valid 0..{num_replicas_in_sync - 1})"
            )

    @property
    def replica_id_in_sync_group(self) -> int:
        """The replica's id among all replicas of all workers, 0-based."""
        return self._replica_id_in_sync_group

    @property
    def num_replicas_in_sync(self) -> int:
        """Replicas that take part in one step, all workers together."""
        return self._num_replicas_in_sync

    def __repr__(self) -> str:
        return (f"ValueContext(replica_id_in_sync_group={self._replica_id_in_sync_group}, "
                f"num_replicas_in_sync={self._num_replicas_in_sync})")


class InputContext:
    """Where one input pipeline sits: how many there are, which one it is, how many replicas.

    Passed to ``dataset_fn`` by ``strategy.distribute_datasets_from_function`` so that the
    function can shard its data (keep pipeline ``input_pipeline_id`` of
    ``num_input_pipelines``) and batch by the per-replica batch size.

    Equivalent: ``tf.distribute.InputContext``; unison also checks the arguments.

    Args:
        num_input_pipelines: number of input pipelines in the cluster (usually workers).
        input_pipeline_id: this pipeline's index, ``0 <= id < num_input_pipelines``.
        num_replicas_in_sync: replicas that take part in one training step, all workers
            together.

    Raises:
        TypeError: if an argument is not an int.
        ValueError: if a count is below 1 or the id is out of range.

    Example:
        >>> ctx = InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=4)
        >>> ctx.get_per_replica_batch_size(64)
        16
    """

    __slots__ = ("_num_input_pipelines", "_input_pipeline_id", "_num_replicas_in_sync")

    def __init__(self, num_input_pipelines: int = 1, input_pipeline_id: int = 0, num_replicas_in_sync: int = 1):
        self._num_input_pipelines = require_int("num_input_pipelines", num_input_pipelines, minimum=1)
        self._input_pipeline_id = require_int("input_pipeline_id", input_pipeline_id, minimum=0)
        self._num_replicas_in_sync = require_int("num_replicas_in_sync", num_replicas_in_sync, minimum=1)
        if input_pipeline_id >= num_input_pipelines:
            raise ValueError(
                f"`input_pipeline_id` {input_pipeline_id!r} is out of range: there are "
                f"{num_input_pipelines} input pipelines (valid 0..{num_input_pipelines - 1})"
            )

    @property
    def num_input_pipelines(self) -> int:
        """Number of input pipelines in the cluster."""
        return self._num_input_pipelines

    @property
    def input_pipeline_id(self) -> int:
        """Index of this input pipeline, in ``range(num_input_pipelines)``."""
        return self._input_pipeline_id

    @property
    def num_replicas_in_sync(self) -> int:
        """Number of replicas in one synchronous step, all workers together."""
        return self._num_replicas_in_sync

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """Returns the batch size each replica gets from ``global_batch_size``.

        Args:
            global_batch_size: rows consumed by one step across all replicas.

        Returns:
            ``global_batch_size // num_replicas_in_sync``.

        Raises:
            TypeError: if ``global_batch_size`` is not an int.
            ValueError: if it is negative or not divisible by ``num_replicas_in_sync``.
        """
        require_int("global_batch_size", global_batch_size, minimum=0)
        if global_batch_size % self._num_replicas_in_sync:
            n = self._num_replicas_in_sync
            raise ValueError(
                f"`global_batch_size` {global_batch_size!r} is not divisible by "
                f"`num_replicas_in_sync` {n!r}: use a multiple of {n} "
                f"(e.g. {max(n, global_batch_size - global_batch_size % n)})"
            )
        return global_batch_size // self._num_replicas_in_sync

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, InputContext):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def _key(self) -> tuple[int, int, int]:
        return (self._num_input_pipelines, self._input_pipeline_id, self._num_replicas_in_sync)

    def __repr__(self) -> str:
        return (
            f"InputContext(num_input_pipelines={self._num_input_pipelines}, "
            f"input_pipeline_id={self._input_pipeline_id}, "
            f"num_replicas_in_sync={self._num_replicas_in_sync})"
        )


@dataclasses.dataclass(frozen=True)
class InputOptions:
    """How distributed datasets deliver their batches.

    Equivalent: ``tf.distribute.InputOptions`` (``experimental_fetch_to_device``,
    ``experimental_replication_mode``); ``pin_memory`` and ``auto_shard_policy`` are
    unison's (TensorFlow sets the shard policy on the dataset's options).

    Attributes:
        experimental_fetch_to_device: move each replica's batch to that replica's device
            before handing it out (default). When False, components stay where the
            dataset produced them (on the host) and the step moves them itself.
        experimental_replication_mode: ``PER_WORKER`` (default) or ``PER_REPLICA``; only
            ``distribute_datasets_from_function`` accepts ``PER_REPLICA``.
        pin_memory: copy host tensors to pinned memory before a non-blocking copy to a
            CUDA device. No effect for CPU devices or when fetching is off.
        auto_shard_policy: how ``experimental_distribute_dataset`` shards between workers.

    Raises:
        TypeError: if a flag is not a bool.
        ValueError: if a mode or policy is not a member (or member name) of its enum.
    """

    experimental_fetch_to_device: bool = True
    experimental_replication_mode: InputReplicationMode = InputReplicationMode.PER_WORKER
    pin_memory: bool = False
    auto_shard_policy: AutoShardPolicy = AutoShardPolicy.AUTO

    def __post_init__(self) -> None:
        for field in ("experimental_fetch_to_device", "pin_memory"):
            value = getattr(self, field)
            if not isinstance(value, bool):
                raise TypeError(f"InputOptions `{field}` must be a bool, got {type(value).__name__}: {value!r}")
        object.__setattr__(
            self,
            "experimental_replication_mode",
            _coerce_enum(
                "experimental_replication_mode", self.experimental_replication_mode, InputReplicationMode
            ),
        )
        object.__setattr__(
            self, "auto_shard_policy", _coerce_enum("auto_shard_policy", self.auto_shard_policy, AutoShardPolicy)
        )
