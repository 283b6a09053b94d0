"""CommunicationOptions and CommunicationImplementation (``tf.distribute.experimental.CommunicationOptions``)."""

from __future__ import annotations

import dataclasses

from unison._enums import NamedEnum

__all__ = ["CommunicationImplementation", "CommunicationOptions", "Compression", "PowerSGD"]


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
    (gradient buckets and ``reduce``/``batch_reduce_to`` across workers); replicas in
    one process exchange nothing. Across several hosts of several workers (the
    hierarchical transport) the workers of a host sum exactly in shared memory, which has
    no wire to save, and the host sums cross the network in the half type. Elsewhere
    (one host, ``RING``, NCCL, one worker per host) every worker's share travels
    compressed over the network collectives.
    """

    NONE = "NONE"
    BF16 = "BF16"
    FP16 = "FP16"

    @classmethod
    def _argument_name(cls) -> str:
        return "CommunicationOptions.compression"


@dataclasses.dataclass(frozen=True)
class PowerSGD:
    """PowerSGD gradient compression (Vogels et al., 2019; DDP's ``powerSGD_hook``).

    Each gradient matrix ``M`` (a parameter of 2 or more dimensions, viewed as
    ``[shape[0], -1]``) travels as two thin factors: ``P = M Q`` is all-reduced and
    orthonormalised, then ``Q = M^T P`` is all-reduced, and every worker applies ``P Q^T``.
    What the approximation missed is kept per parameter and added to the next step's
    gradient (error feedback), and ``Q`` is reused as the next step's start (warm start),
    so over steps the applied updates add up to the true gradients. Vectors (biases),
    matrices too small to gain, and every gradient during the first ``start_iter``
    steps are all-reduced exactly. Applies to gradient buckets between workers;
    ``reduce``/``batch_reduce_to`` stay exact. The factors are summed by the transport
    the cluster calls for: across several hosts of several workers, the hierarchical one
    (shared memory within a host, once per host across the network).

    Args:
        rank: the factors' rank (1 is DDP's default; higher is more precise, more bytes).
        start_iter: exact steps first (DDP's default 10), while gradients change fast.
        min_compression_rate: a matrix ``n x m`` is compressed only when
            ``n * m >= min_compression_rate * rank * (n + m)``.
        seed: the seed of the initial ``Q`` (the same on every worker).

    Raises:
        ValueError: naming the argument, for a rank < 1, a negative start_iter, or a
            min_compression_rate < 1.
    """

    rank: int = 1
    start_iter: int = 10
    min_compression_rate: float = 2.0
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"PowerSGD.rank must be an int >= 1, got {self.rank!r}; 1 is DDP's default")
        if isinstance(self.start_iter, bool) or not isinstance(self.start_iter, int) or self.start_iter < 0:
            raise ValueError(f"PowerSGD.start_iter must be an int >= 0, got {self.start_iter!r}")
        if not self.min_compression_rate >= 1:
            raise ValueError(f"PowerSGD.min_compression_rate must be >= 1, got {self.min_compression_rate!r}")


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
            :class:`Compression` (a member or its name, e.g. ``"bf16"``; None: exact),
            or a :class:`PowerSGD` for low-rank gradient compression.

    Raises:
        ValueError: for a negative ``bytes_per_pack``, a non-positive timeout, or an
            unknown implementation or compression.
    """

    bytes_per_pack: int = 0
    timeout_seconds: float | None = None
    implementation: CommunicationImplementation = CommunicationImplementation.AUTO
    compression: Compression | PowerSGD = Compression.NONE

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
        if not isinstance(compression, PowerSGD):
            object.__setattr__(self, "compression", Compression.from_any(compression))

    @property
    def effective_timeout(self) -> float:
        """The timeout in seconds that collectives use."""
        return float(self.timeout_seconds) if self.timeout_seconds is not None else 300.0

    def merge(self, other: CommunicationOptions | None) -> CommunicationOptions:
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
