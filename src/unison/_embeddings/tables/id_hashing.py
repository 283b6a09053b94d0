"""SplitMix64 over int64 tensors, and the shard an id lives on.

A dynamic embedding table is keyed by arbitrary int64 ids (64-bit feature hashes,
negative ones included), so everything that places or initialises a row hashes the id
instead of trusting it to be dense or uniform. The hash is SplitMix64's finaliser
(Steele, Lea and Flood, "Fast splittable pseudorandom number generators", 2014), run in
numpy's uint64 arithmetic, in place: logical shifts and wrapping products, five operations
where torch's int64 needed eleven, each a new tensor (2-3x faster, the same bits). Tables
live on the CPU; ids on another device are hashed there. It is a bijection of the 64-bit
integers, so distinct ids never collide before a final reduction.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["splitmix64", "splitmix64_in_place", "splitmix64_int", "shard_of", "bucket_of", "unit_interval",
           "GOLDEN_GAMMA"]

_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    value &= _MASK64
    return value - (1 << 64) if value >> 63 else value


#: SplitMix64's stream increment, 0x9E3779B97F4A7C15, as a signed int64.
GOLDEN_GAMMA = _signed(0x9E3779B97F4A7C15)
# Added to an id before hashing it for placement, so a shard and the position of the id
# in a shard's hash index (which uses the same finaliser) are unrelated.
_SHARD_SALT = _signed(0xD1B54A32D192ED03)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 values (torch's ``>>`` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


_NP_MUL1, _NP_MUL2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_NP_30, _NP_27, _NP_31, _NP_1 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(1)


def splitmix64_in_place(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser over a uint64 array, in place; returns it."""
    z ^= z >> _NP_30
    z *= _NP_MUL1
    z ^= z >> _NP_27
    z *= _NP_MUL2
    z ^= z >> _NP_31
    return z


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser applied elementwise to an int64 tensor (bits as unsigned).

    ``z ^= z >> 30; z *= 0xBF58476D1CE4E5B9; z ^= z >> 27; z *= 0x94D049BB133111EB;
    z ^= z >> 31`` modulo 2**64, returned as a new int64 tensor with the same bits.
    """
    if x.dtype != torch.int64:
        raise TypeError(f"splitmix64 needs an int64 tensor, got dtype {x.dtype}; fix: pass x.long()")
    words = x.detach().cpu().numpy().astype(np.uint64)  # a copy of the same bits, mixed in place
    return torch.from_numpy(splitmix64_in_place(words).view(np.int64)).to(x.device)


def splitmix64_int(x: int) -> int:
    """The same finaliser on one Python int (its low 64 bits), returned as a signed int64."""
    z = x & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return _signed(z ^ (z >> 31))


def shard_of(ids: torch.Tensor, num_shards: int) -> torch.Tensor:
    """The shard (``0 .. num_shards - 1``) that each int64 id lives on.

    ``(splitmix64(id + 0xD1B54A32D192ED03) >> 1) % num_shards`` with wrapping addition and
    the hash read as unsigned. This is a stable function of the id alone: a checkpoint
    written with one shard count is re-split for another by calling it again, and the
    formula must never change. It is not ``id % num_shards``, which puts sequential ids
    (and hashes that share low bits) on shards in a fixed cycle, so a range of popular
    ids or a family of hashes lands unevenly; the mixed hash spreads any id pattern.

    Args:
        ids: int64 tensor of any shape.
        num_shards: number of shards, >= 1.

    Returns:
        int64 tensor of the shape of ``ids``.
    """
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
        raise ValueError(f"shard_of: `num_shards` must be an int >= 1, got {num_shards!r}")
    if ids.dtype != torch.int64:
        raise TypeError(f"shard_of: `ids` must be an int64 tensor, got dtype {ids.dtype}; fix: pass ids.long()")
    return _salted_buckets(ids, _SHARD_SALT, num_shards)


def _salted_buckets(ids: torch.Tensor, salt: int, buckets: int) -> torch.Tensor:
    """``(splitmix64(id + salt) >> 1) % buckets`` in numpy's wrapping uint64 arithmetic, in place on one
    copy: half the time of the same torch ops (a worker splits every lookup's ids by it)."""
    words = ids.detach().cpu().numpy().astype(np.uint64)  # the same bits
    words += np.uint64(salt & _MASK64)
    splitmix64_in_place(words)
    words >>= _NP_1
    words %= np.uint64(buckets)
    return torch.from_numpy(words.view(np.int64)).to(ids.device)


def bucket_of(ids: torch.Tensor, salt: int, buckets: int) -> torch.Tensor:
    """``(splitmix64(id + salt) >> 1) % buckets`` (the hash read as unsigned): a bucket per int64 id.

    :func:`shard_of` with another salt: a family of independent bucket hashes, e.g. the rows
    of a count sketch. A salt equal to ``shard_of``'s gives its buckets.
    """
    return _salted_buckets(ids, salt, buckets)


def unit_interval(hashes: torch.Tensor) -> torch.Tensor:
    """Float64 values in ``[0, 1)`` from the top 53 bits of int64 hashes (uniform when the hashes are)."""
    return _shift_right(hashes, 11).to(torch.float64) * (1.0 / (1 << 53))
