"""An unbounded click stream whose behaviour drifts: the stand-in for a message queue in ``online_ctr.py``.

Samples have ``ctr_data``'s Criteo schema and hidden click model, plus a drift: the ids of
one feature are items in ``GROUPS`` groups (by hash), and group ``g``'s click logit moves
by ``amplitude * sin(2 pi (position / period + g / GROUPS))`` as the stream goes on. The
popular groups take turns, so a model frozen at one moment scores later clicks worse and
online training has something to follow; the mean click rate stays about the same.

The stream is addressed by position (samples since it began): the batch at a position is
the same for every reader, so worker ``r`` of ``W`` reads its own partition (start
``r * batch``, stride ``W * batch``) and the serving process draws held-out samples of the
moment the trainer has reached (another ``seed``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from ctr_data import CtrData, make_ctr_data

from unison._embeddings.tables.id_hashing import splitmix64, splitmix64_int

__all__ = ["ITEM_FEATURE", "GROUPS", "drift_logits", "batch_at", "drifting_clicks"]

ITEM_FEATURE = 0  # Criteo's C1: 1460 values, frequent enough for a row to follow its group's drift
GROUPS = 8
_GROUP_SALT = 0x17E_6A0B


def drift_logits(sparse: torch.Tensor, position: int, period: int, amplitude: float) -> torch.Tensor:
    """The drift added to each sample's click logit at stream ``position`` (``[N]`` float32)."""
    group = torch.remainder(splitmix64(sparse[:, ITEM_FEATURE] ^ _GROUP_SALT), GROUPS).float()
    return amplitude * torch.sin(2 * math.pi * (position / period + group / GROUPS))


def batch_at(position: int, size: int, *, seed: int, period: int, amplitude: float) -> CtrData:
    """The ``size`` samples of the stream at ``position`` (the same for every reader of ``seed``), with their
    true click probabilities (the drift included)."""
    draw_seed = splitmix64_int(seed << 40 ^ position) & (2**63 - 1)
    data = make_ctr_data(size, seed=draw_seed)
    assert data.probabilities is not None
    p = data.probabilities.double().clamp(1e-7, 1 - 1e-7)
    logits = torch.log(p / (1 - p)).float() + drift_logits(data.sparse, position, period, amplitude)
    probabilities = torch.sigmoid(logits)
    generator = torch.Generator().manual_seed(draw_seed ^ 0x5EED)
    labels = (torch.rand(size, generator=generator) < probabilities).float()
    return CtrData(data.dense, data.sparse, labels, probabilities)


def drifting_clicks(batch_size: int, *, seed: int = 0, start: int = 0, stride: int | None = None,
                    period: int = 200_000, amplitude: float = 1.5) -> Iterator[tuple[int, CtrData]]:
    """``(position, batch)`` from ``start`` on, every ``stride`` samples (default: ``batch_size``), forever.

    Args:
        batch_size: samples per batch.
        seed: the stream (training and held-out data are two seeds of one drift).
        start, stride: this reader's partition of the stream, in samples.
        period: samples for a group's click propensity to go round once.
        amplitude: the drift's size in logits (0: no drift).
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"drifting_clicks: `batch_size` must be an int >= 1, got {batch_size!r}")
    if isinstance(period, bool) or not isinstance(period, int) or period < 1:
        raise ValueError(f"drifting_clicks: `period` must be an int >= 1 (samples), got {period!r}")
    step = batch_size if stride is None else stride
    if step < 1:
        raise ValueError(f"drifting_clicks: `stride` must be >= 1, got {stride!r}")
    position = start
    while True:
        yield position, batch_at(position, batch_size, seed=seed, period=period, amplitude=amplitude)
        position += step
