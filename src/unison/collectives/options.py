"""CommunicationOptions and CommunicationImplementation (``tf.distribute.experimental.CommunicationOptions``)."""

from __future__ import annotations

import dataclasses

from unison._enums import NamedEnum

__all__ = ["CommunicationImplementation", "CommunicationOptions", "Compression"]


class CommunicationImplementation(NamedEnum):
    """Which torch.distributed backend carries cross-process collectives.

    ``AUTO``: NCCL when the replicas are CUDA devices and NCCL is available, else gloo;
    on gloo, batch all-reduces between workers of one host go through shared memory.
    ``RING``: gloo's ring all-reduce over the network for every batch, even on one host.
    ``NCCL``: NCCL, CUDA only.
    """

    AUTO = "AUTO"
    RING = "RING"
    NCCL = "NCCL"

    @classmethod
    def _argument_name(cls) -> str:
        return "implementation"


class Compression(NamedEnum):
    """How gradients and batch reductions travel between workers (DDP's comm hooks, as an option).

    ``NONE``: exact, in the tensors' own dtype.
    ``BF16``: floating-point tensors are divided (for a mean), cast to bfloat16, summed
    as bfloat16 and cast back: half the bytes, float32's range, 8 bits of mantissa
    (DDP's ``bf16_compress_hook``).
    ``FP16``: the same in float16 (DDP's ``fp16_compress_hook``), with float16's smaller
    range made safe: a sum that overflows (non-finite where the inputs were finite) is
    done again exactly, so an overflow never reaches the weights.

    Integer tensors are always exact. Only traffic between workers is compressed
    (gradient buckets and ``reduce``/``batch_reduce_to`` across workers, over every
    transport: compressed tensors always travel over the network collectives, since
    shared memory has no wire to save); replicas in one process exchange nothing.
    """

    NONE = "NONE"
    BF16 = "BF16"
    FP16 = "FP16"

    @classmethod
    def _argument_name(cls) -> str:
        return "CommunicationOptions.compression"


@dataclasses.dataclass(frozen=True)
class CommunicationOptions:
    """Options for cross-process collectives.

    Args:
        bytes_per_pack: split a batch all-reduce into packs of about this many bytes
            (0: unison chooses: one pack per dtype, sent as two concurrent halves from
            4 MiB on). Packs are formed in reverse order, so the last gradients computed
            travel first, and all travel at once. Also the gradient bucket size of the
            backward-overlapped all-reduce (0: unison's default, 4 MiB). Batches that
            go through shared memory are not cut into packs.
        timeout_seconds: bound on every collective; a peer that does not answer in time
            raises ``unison.errors.PeerLostError`` naming it. None: 300 s.
        implementation: the backend, see :class:`CommunicationImplementation`.
        compression: how floating-point traffic between workers is compressed, see
            :class:`Compression` (a member or its name, e.g. ``"bf16"``; None: exact).

    Raises:
        ValueError: for a negative ``bytes_per_pack``, a non-positive timeout, or an
            unknown implementation or compression.
    """

    bytes_per_pack: int = 0
    timeout_seconds: float | None = None
    implementation: CommunicationImplementation = CommunicationImplementation.AUTO
    compression: Compression = Compression.NONE

    def __post_init__(self) -> None:
        if isinstance(self.bytes_per_pack, bool) or not isinstance(self.bytes_per_pack, int) or self.bytes_per_pack < 0:
            raise ValueError(
                f"CommunicationOptions.bytes_per_pack must be an int >= 0, got {self.bytes_per_pack!r}; "
                f"use 0 to let unison choose"
            )
        if self.timeout_seconds is not None and not self.timeout_seconds > 0:
            raise ValueError(
                f"CommunicationOptions.timeout_seconds must be > 0 or None, got {self.timeout_seconds!r}"
            )
        object.__setattr__(self, "implementation", CommunicationImplementation.from_any(self.implementation))
        compression = Compression.NONE if self.compression is None else self.compression
        object.__setattr__(self, "compression", Compression.from_any(compression))

    @property
    def effective_timeout(self) -> float:
        """The timeout in seconds that collectives use."""
        return float(self.timeout_seconds) if self.timeout_seconds is not None else 300.0

    def merge(self, other: "CommunicationOptions | None") -> "CommunicationOptions":
        """Options of ``other`` where it differs from the defaults, else these."""
        if other is None:
            return self
        defaults = CommunicationOptions()
        changes = {
            f.name: getattr(other, f.name)
            for f in dataclasses.fields(self)
            if getattr(other, f.name) != getattr(defaults, f.name)
        }
        return dataclasses.replace(self, **changes)
