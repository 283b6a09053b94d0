"""Gradient compression on the wire: floating-point tensors travel as bfloat16 or float16.

DDP offers this as communication hooks (``bf16_compress_hook``, ``fp16_compress_hook``);
unison as an option, ``CommunicationOptions(compression=...)``, for gradient buckets and
batch reductions alike. A tensor is divided first (for a mean, so its values stay in
the half type's range), cast, summed in the half type by the collective, and cast back
into its own dtype: half the bytes of float32 on the network, at the half type's
precision.

float16's range is small (65504): a sum that overflows is *not* accepted. When a
reduced float16 tensor holds a non-finite value, that tensor is reduced again, exactly,
in its own dtype. Every worker takes the same decision without a word: an all-reduce
hands every worker the very same reduced tensor. (Inputs that are already non-finite
give a non-finite exact sum too, as without compression.)
"""

from __future__ import annotations

import typing

import torch

from unison._collectives.options import Compression

__all__ = ["Compressor"]

_WIRE_DTYPES = {Compression.BF16: torch.bfloat16, Compression.FP16: torch.float16}


@typing.final
class Compressor:
    """Casts for one :class:`Compression` (not NONE): what travels, and when to redo a sum exactly."""

    def __init__(self, compression: Compression):
        if compression not in _WIRE_DTYPES:
            raise ValueError(f"Compressor needs BF16 or FP16, got {compression!r}")
        self.compression = compression
        self.wire_dtype = _WIRE_DTYPES[compression]
        self._checks_overflow = compression is Compression.FP16

    def compresses(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` travels compressed: floating point, wider than the wire type, dense."""
        return (tensor.is_floating_point() and tensor.dtype.itemsize > self.wire_dtype.itemsize
                and tensor.layout == torch.strided)

    def to_wire(self, tensor: torch.Tensor, divisor: int = 1, out: torch.Tensor | None = None) -> torch.Tensor:
        """``tensor / divisor`` in the wire dtype (into ``out`` when given)."""
        source = tensor / divisor if divisor != 1 else tensor
        if out is None:
            return source.to(self.wire_dtype)
        return out.copy_(source)

    def overflowed(self, reduced: torch.Tensor) -> bool:
        """Whether a reduced wire tensor must be reduced again exactly (float16 only)."""
        # The largest magnitude: an inf anywhere makes it inf, and a nan propagates through
        # max; a full-size isfinite mask costs far more (benchmarks/RESULTS.md, 'fp16
        # overflow check by max').
        return (self._checks_overflow and reduced.numel() > 0
                and not bool(torch.isfinite(reduced.abs().max())))
