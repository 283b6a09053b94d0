"""How a dynamic table makes a row it has never seen: a pure function of (seed, id, column).

A row is created on first touch, which on a ps cluster may happen on any shard, in any
order, or again after the row was evicted; a checkpoint re-split over more shards must
not change the rows still to be created. So initial values are not drawn from torch's
generator (whose output depends on how many values were drawn before) but counted from
a hash: the row of ``id`` is the output of SplitMix64 seeded with
``key = splitmix64(id XOR splitmix64(seed))``, its ``k``-th draw (``k = 1, 2, ...``)
being ``u_k = splitmix64(key + k * 0x9E3779B97F4A7C15)`` (wrapping, read as unsigned).
A draw becomes a float64 in ``[0, 1)`` as ``(u_k >> 11) * 2**-53``; the arithmetic is
float64 and the result is rounded once to the table's dtype. Everything is vectorised
over the batch of ids and the columns.
"""

from __future__ import annotations

import abc
import math
from typing import Any, final

import numpy as np
import torch

from unison._embeddings.tables.id_hashing import GOLDEN_GAMMA, splitmix64_in_place, splitmix64_int

__all__ = ["Initializer", "Uniform", "Normal", "Zeros", "uniform", "normal", "zeros", "initializer_from_config",
           "hash_draws"]

_TWO_POW_MINUS_53 = 2.0 ** -53
_MASK64 = (1 << 64) - 1
_GAMMA64 = GOLDEN_GAMMA & _MASK64  # as unsigned


def hash_draws(ids: torch.Tensor, seed: int, count: int) -> torch.Tensor:
    """``[len(ids), count]`` float64 draws in ``[0, 1)``: draw ``k`` (1-based) of each id's stream.

    In numpy's uint64 arithmetic, in place (the same bits as torch's int64 one, 2-3x faster:
    a new row's draws were a fifth of a table's work where many ids were new)."""
    id_bits = ids.detach().cpu().numpy().view(np.uint64)
    keys = splitmix64_in_place(id_bits ^ np.uint64(splitmix64_int(seed) & _MASK64))
    words = splitmix64_in_place(keys[:, None] + np.arange(1, count + 1, dtype=np.uint64) * np.uint64(_GAMMA64))
    words >>= np.uint64(11)
    draws = words.astype(np.float64)
    draws *= _TWO_POW_MINUS_53
    return torch.from_numpy(draws).to(ids.device)


def _number(value: Any, field: str, owner: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{owner}: `{field}` must be a finite number, got {value!r}")
    return float(value)


class Initializer(abc.ABC):
    """Makes the initial rows of a batch of ids, reproducibly from (seed, id, column)."""

    @abc.abstractmethod
    def __call__(self, ids: torch.Tensor, embedding_dim: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
        """``[len(ids), embedding_dim]`` rows of ``dtype`` for a 1-D int64 tensor of ids."""

    @abc.abstractmethod
    def config(self) -> dict[str, Any]:
        """A JSON-able description that :func:`initializer_from_config` turns back into the initializer."""


@final
class Uniform(Initializer):
    """Uniform on ``[a, b)``: column ``c`` of a row is ``a + (b - a) * draw_{c+1}``."""

    def __init__(self, a: float = -0.05, b: float = 0.05) -> None:
        self.a, self.b = _number(a, "a", "uniform"), _number(b, "b", "uniform")
        if not self.a < self.b:
            raise ValueError(f"uniform: needs a < b, got a={a!r}, b={b!r}")

    def __call__(self, ids: torch.Tensor, embedding_dim: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
        return (self.a + (self.b - self.a) * hash_draws(ids, seed, embedding_dim)).to(dtype)

    def config(self) -> dict[str, Any]:
        return {"kind": "uniform", "a": self.a, "b": self.b}

    def __repr__(self) -> str:
        return f"uniform(a={self.a!r}, b={self.b!r})"


@final
class Normal(Initializer):
    """Normal(mean, std**2) by Box-Muller: column ``c`` uses draws ``2c+1`` and ``2c+2``,
    ``mean + std * sqrt(-2 ln(1 - draw_{2c+1})) * cos(2 pi draw_{2c+2})``."""

    def __init__(self, mean: float = 0.0, std: float = 1.0) -> None:
        self.mean, self.std = _number(mean, "mean", "normal"), _number(std, "std", "normal")
        if self.std < 0:
            raise ValueError(f"normal: `std` must be >= 0, got {std!r}")

    def __call__(self, ids: torch.Tensor, embedding_dim: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
        draws = hash_draws(ids, seed, 2 * embedding_dim)
        radius = torch.sqrt(-2.0 * torch.log1p(-draws[:, 0::2]))  # 1 - draw is in (0, 1]: log is finite
        return (self.mean + self.std * radius * torch.cos(2.0 * math.pi * draws[:, 1::2])).to(dtype)

    def config(self) -> dict[str, Any]:
        return {"kind": "normal", "mean": self.mean, "std": self.std}

    def __repr__(self) -> str:
        return f"normal(mean={self.mean!r}, std={self.std!r})"


@final
class Zeros(Initializer):
    """Every new row is zeros."""

    def __call__(self, ids: torch.Tensor, embedding_dim: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(ids.numel(), embedding_dim, dtype=dtype)

    def config(self) -> dict[str, Any]:
        return {"kind": "zeros"}

    def __repr__(self) -> str:
        return "zeros()"


def uniform(a: float = -0.05, b: float = 0.05) -> Uniform:
    """New rows uniform on ``[a, b)`` (float64 maths, rounded to the table's dtype)."""
    return Uniform(a, b)


def normal(mean: float = 0.0, std: float = 1.0) -> Normal:
    """New rows normal with ``mean`` and ``std`` (``nn.Embedding``'s default is ``normal(0, 1)``)."""
    return Normal(mean, std)


def zeros() -> Zeros:
    """New rows all zeros."""
    return Zeros()


_BUILT_INS: dict[str, type[Initializer]] = {"uniform": Uniform, "normal": Normal, "zeros": Zeros}


def initializer_from_config(config: dict[str, Any]) -> Initializer:
    """The built-in initializer that ``config()`` described."""
    fields = dict(config)
    kind = fields.pop("kind", None)
    if kind not in _BUILT_INS:
        raise ValueError(f"initializer config names kind {kind!r}, which is not a built-in ({sorted(_BUILT_INS)}); "
                         f"fix: pass the initializer object itself (e.g. LocalTable.from_export(..., initializer=...))")
    return _BUILT_INS[kind](**fields)
