"""Hugging Face Transformers models (tiny configurations, random init) under unison, against DDP.

GPT-2 ties its LM head to the token embedding (one variable in scope) and BERT keeps
constant buffers (``position_ids``, ``token_type_ids``); every dropout is off, so DDP and
unison compute the same function. Nothing is downloaded: the models are built from
configurations.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.real_models import _harness as h

pytestmark = h.requires("transformers")

STEPS = 4
VOCAB = 100
TOKENS = 16
PER_REPLICA = 4
LABELS = 3


def _quiet_transformers():
    transformers = h.import_transformers()
    transformers.logging.set_verbosity_error()  # config notes about unused token ids and loss types
    return transformers


def gpt2() -> nn.Module:
    transformers = _quiet_transformers()
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def bert_classifier() -> nn.Module:
    transformers = _quiet_transformers()
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=32, num_labels=LABELS,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0)
    return transformers.BertForSequenceClassification(config)


def tokens(generator: torch.Generator) -> h.Batch:
    return (torch.randint(0, VOCAB, (2 * PER_REPLICA, TOKENS), generator=generator),)


def labelled_tokens(generator: torch.Generator) -> h.Batch:
    rows = 2 * PER_REPLICA
    return (torch.randint(1, VOCAB, (rows, TOKENS), generator=generator),
            torch.randint(0, LABELS, (rows,), generator=generator))


def causal_lm_loss(model: nn.Module, batch: h.Batch) -> torch.Tensor:
    (ids,) = batch
    return model(input_ids=ids, labels=ids).loss


def classification_loss(model: nn.Module, batch: h.Batch) -> torch.Tensor:
    ids, labels = batch
    return model(input_ids=ids, labels=labels).loss


@pytest.mark.timeout(90)
@pytest.mark.parametrize("strategy_kind", ["mwms", "mirrored"])
def test_gpt2_lm_matches_ddp(worker_pool, strategy_kind):
    h.run_case(worker_pool, strategy_kind, gpt2, causal_lm_loss, tokens, STEPS, "GPT2LMHeadModel")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("strategy_kind", ["mwms", "mirrored"])
def test_bert_classifier_matches_ddp(worker_pool, strategy_kind):
    h.run_case(worker_pool, strategy_kind, bert_classifier, classification_loss, labelled_tokens, STEPS,
               "BertForSequenceClassification")
