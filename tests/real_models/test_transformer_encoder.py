"""A small ``nn.TransformerEncoder`` language model under unison, against DDP.

``nn.TransformerEncoder`` builds its layers with ``copy.deepcopy`` of the layer it is
given, so every layer after the deep copy holds parameters unison never created through
``nn.Parameter`` in scope. Each must still be a distributed variable: all-reduced across
workers (MultiWorkerMirrored) and one copy per replica thread (Mirrored). No BatchNorm,
no dropout: the model has no buffers, and DDP's parameters are one device's on the
global batch.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.real_models import _harness as h

STEPS = 4
VOCAB = 50
WIDTH = 32
TOKENS = 12
PER_REPLICA = 4


class EncoderLM(nn.Module):
    """Token and position embeddings, a causal 2-layer ``nn.TransformerEncoder``, a vocabulary head."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, WIDTH)
        self.positions = nn.Embedding(TOKENS, WIDTH)
        layer = nn.TransformerEncoderLayer(WIDTH, nhead=2, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
        x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1]))
        return self.head(self.encoder(x, mask=mask, is_causal=True))


def encoder_lm() -> nn.Module:
    return EncoderLM()


def token_batch(generator: torch.Generator) -> h.Batch:
    return (torch.randint(0, VOCAB, (2 * PER_REPLICA, TOKENS), generator=generator),)


def next_token_loss(model: nn.Module, batch: h.Batch) -> torch.Tensor:
    (ids,) = batch
    logits = model(ids[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("strategy_kind", ["mwms", "mirrored"])
def test_transformer_encoder_lm_matches_ddp(worker_pool, strategy_kind):
    h.run_case(worker_pool, strategy_kind, encoder_lm, next_token_loss, token_batch, STEPS, "TransformerEncoder LM")
