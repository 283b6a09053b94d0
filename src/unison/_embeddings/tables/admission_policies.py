"""Feature admission: which ids get a row, from how often training lookups asked for them.

Most ids of a click-through stream appear once or twice; giving each a row and optimizer
state on first sight spends most of a table's memory on rows that never train. With an
admission policy an id without a row reads zeros (a zero row in a bag's sum or mean) and
gets no update until the policy admits it; the lookup that admits it makes its row (from
the initializer and the id alone, as without a policy), reads it for every occurrence of
that batch, and the batch's gradient applies to it.

An id's count is its occurrences in training lookups (``lookup(create=True)``: a module in
training mode with grad enabled); evaluation never counts. Counts of ids without a row
live in a :class:`~unison._embeddings.tables.count_sketch.CountMinSketch` of
``sketch_depth x sketch_width`` int32 counters per table shard (bounded memory; an
estimate is never below the true count, so a collision can only admit early); once an id
has a row its count lives beside the row, and an evicted id counts from 0 again.

Policies are pure functions of the id, the table seed and its counts, so they decide the
same on every worker, on every ps task layout and after a restart (the sketch is part of
a table's checkpoint).

tf.distribute equivalent: none in core TensorFlow; DeepRec's ``CounterFilter`` and
``CBFFilter`` (a counting Bloom filter), Monolith's frequency filter, Persia's admission
probability.
"""

from __future__ import annotations

import abc
import math
from typing import Any, final

import torch

from unison._embeddings.tables.id_hashing import GOLDEN_GAMMA, splitmix64, splitmix64_int, unit_interval

__all__ = ["AdmissionPolicy", "AdmitAfter", "AdmitWithProbability", "DEFAULT_SKETCH_WIDTH", "DEFAULT_SKETCH_DEPTH",
           "occurrence_draws"]

DEFAULT_SKETCH_WIDTH = 1 << 20
"""Counters per sketch row by default: 4 rows of 2**20 int32, 16 MiB per table shard."""
DEFAULT_SKETCH_DEPTH = 4

_DRAW_SALT = 0x2545F4914F6CDD1D  # mixed with the table seed: admission draws unrelated to initial values


def _sketch_size(owner: str, width: Any, depth: Any) -> tuple[int, int]:
    for field, value in (("sketch_width", width), ("sketch_depth", depth)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{owner}: `{field}` must be an int >= 1, got {value!r}; fix: e.g. "
                             f"sketch_width={DEFAULT_SKETCH_WIDTH}, sketch_depth={DEFAULT_SKETCH_DEPTH} (the defaults)")
    return width, depth


def _sketch_repr(width: int, depth: int) -> str:
    parts = [] if width == DEFAULT_SKETCH_WIDTH else [f"sketch_width={width!r}"]
    if depth != DEFAULT_SKETCH_DEPTH:
        parts.append(f"sketch_depth={depth!r}")
    return "".join(f", {part}" for part in parts)


class AdmissionPolicy(abc.ABC):
    """Decides which ids without a row get one, from their counts; holds the sketch's size.

    Attributes:
        sketch_width: counters per row of the count sketch of each table shard.
        sketch_depth: rows of the count sketch (independent hashes of the id).
    """

    sketch_width: int = DEFAULT_SKETCH_WIDTH
    sketch_depth: int = DEFAULT_SKETCH_DEPTH

    @abc.abstractmethod
    def admit(self, ids: torch.Tensor, seen: torch.Tensor, occurrences: torch.Tensor, seed: int) -> torch.Tensor:
        """A bool mask: True for each id the policy admits in this lookup.

        Args:
            ids: 1-D int64, distinct ids without a row.
            seen: int64 per id, its count before this lookup (the sketch's estimate).
            occurrences: int64 per id, how often it occurs in this lookup (>= 1).
            seed: the table's seed.
        """


@final
class AdmitAfter(AdmissionPolicy):
    """Admits an id in the training lookup in which its count reaches ``count``.

    Args:
        count: occurrences in training lookups before an id gets a row, >= 1 (1 admits
            every id at once: no filter, but ids never looked up in training read zeros).
        sketch_width: counters per sketch row (memory: ``4 * width * depth`` bytes per
            table shard; size it to a few times the distinct ids expected to wait for a row).
        sketch_depth: sketch rows.

    Raises:
        ValueError: naming the field, for a count or sketch size that is not an int >= 1.

    Example:
        >>> import unison
        >>> emb = unison.DynamicEmbedding(4, admission=AdmitAfter(2))
        >>> _ = emb(torch.tensor([7, 8])); emb.num_rows
        0
        >>> _ = emb(torch.tensor([7])); emb.num_rows
        1
    """

    def __init__(self, count: int, *, sketch_width: int = DEFAULT_SKETCH_WIDTH,
                 sketch_depth: int = DEFAULT_SKETCH_DEPTH) -> None:
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"AdmitAfter: `count` must be an int >= 1 (occurrences before an id gets a row), got "
                             f"{count!r}; fix: e.g. AdmitAfter(2), or admission=None to give every id a row")
        self.count = count
        self.sketch_width, self.sketch_depth = _sketch_size("AdmitAfter", sketch_width, sketch_depth)

    def admit(self, ids: torch.Tensor, seen: torch.Tensor, occurrences: torch.Tensor, seed: int) -> torch.Tensor:
        return seen + occurrences >= self.count

    def __repr__(self) -> str:
        return f"AdmitAfter({self.count!r}{_sketch_repr(self.sketch_width, self.sketch_depth)})"


@final
class AdmitWithProbability(AdmissionPolicy):
    """Admits an id at each of its occurrences with probability ``p``, by a hash, not a random generator.

    Occurrence ``k`` of an id (``k = 0, 1, ...`` over training lookups; its count so far
    plus its place in the lookup) admits it when ``u(id, seed, k) < p``, where ``u`` is
    ``splitmix64(splitmix64(id + s) + k * 0x9E3779B97F4A7C15)`` read as a number in
    ``[0, 1)`` and ``s`` is derived from the table seed. The draw is the same on every
    worker and ps task layout and after a restart; an id seen ``n`` times has a row with
    probability ``1 - (1 - p) ** n``.

    Args:
        p: admission probability per occurrence, in ``(0, 1]``.
        sketch_width: counters per row of the sketch that counts occurrences.
        sketch_depth: sketch rows.

    Raises:
        ValueError: naming ``p`` (outside ``(0, 1]``) or the sketch field.
    """

    def __init__(self, p: float, *, sketch_width: int = DEFAULT_SKETCH_WIDTH,
                 sketch_depth: int = DEFAULT_SKETCH_DEPTH) -> None:
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not math.isfinite(p) or not 0 < p <= 1:
            raise ValueError(f"AdmitWithProbability: `p` must be a probability in (0, 1], got {p!r}; fix: e.g. "
                             f"AdmitWithProbability(0.25), or admission=None to give every id a row")
        self.p = float(p)
        self.sketch_width, self.sketch_depth = _sketch_size("AdmitWithProbability", sketch_width, sketch_depth)

    def admit(self, ids: torch.Tensor, seen: torch.Tensor, occurrences: torch.Tensor, seed: int) -> torch.Tensor:
        return occurrence_draws(ids, seen, occurrences, seed, self.p)

    def __repr__(self) -> str:
        return f"AdmitWithProbability({self.p!r}{_sketch_repr(self.sketch_width, self.sketch_depth)})"


def occurrence_draws(ids: torch.Tensor, seen: torch.Tensor, occurrences: torch.Tensor, seed: int,
                     p: float) -> torch.Tensor:
    """Whether any of occurrences ``seen .. seen + occurrences - 1`` of each id draws below ``p``
    (:class:`AdmitWithProbability`'s rule, vectorised over the occurrences of a lookup)."""
    if not ids.numel():
        return torch.zeros(0, dtype=torch.bool)
    keys = splitmix64(ids + splitmix64_int(seed ^ _DRAW_SALT))
    owner = torch.repeat_interleave(torch.arange(ids.numel()), occurrences)
    starts = torch.cumsum(occurrences, 0) - occurrences
    number = seen.index_select(0, owner) + torch.arange(owner.numel()) - starts.index_select(0, owner)
    u = unit_interval(splitmix64(keys.index_select(0, owner) + number * GOLDEN_GAMMA))
    hits = torch.zeros(ids.numel(), dtype=torch.int64).index_add_(0, owner, (u < p).to(torch.int64))
    return hits > 0
