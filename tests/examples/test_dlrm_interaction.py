"""The DLRM example's interaction (``examples/dlrm.py``: ``pairwise_dots``), whose backward is written by hand.

Checked against plain autograd on ``bmm(V, Vᵀ)`` and the upper triangle's advanced index, the
layout the example used before: the same pairs in the same order, the same gradient (float64), a
numerical ``gradcheck``, and the DLRM's logits and parameter gradients against a copy whose
interaction is the plain one.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import dlrm  # noqa: E402


def _plain_pairs(vectors: torch.Tensor) -> torch.Tensor:
    n = vectors.shape[1]
    upper = torch.triu_indices(n, n, offset=1)
    return torch.bmm(vectors, vectors.transpose(1, 2))[:, upper[0], upper[1]]


@pytest.mark.parametrize("n", [2, 3, 27])
def test_pairs_and_their_gradient_equal_plain_autograd(n):
    torch.manual_seed(n)
    vectors = torch.randn(5, n, 4, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(5, n * (n - 1) // 2, dtype=torch.float64)
    ours = dlrm.pairwise_dots(vectors)
    (ours_grad,) = torch.autograd.grad(ours, vectors, upstream)
    plain = _plain_pairs(vectors)
    (plain_grad,) = torch.autograd.grad(plain, vectors, upstream)
    assert torch.equal(ours, plain)  # the same products, selected in the same order
    assert torch.allclose(ours_grad, plain_grad, rtol=1e-12, atol=1e-12)


def test_gradcheck():
    torch.manual_seed(0)
    vectors = torch.randn(3, 5, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(dlrm.pairwise_dots, (vectors,))


def test_the_dlrm_trains_as_with_plain_autograd(monkeypatch):
    """Logits and every parameter's gradient of the whole model, the embeddings' included, equal a copy
    whose interaction is plain autograd (float32: to rounding, the gradient's sums run in another order)."""
    torch.manual_seed(0)
    embeddings = torch.nn.ModuleList(torch.nn.EmbeddingBag(50, 8, mode="sum") for _ in range(26))
    model = dlrm.DLRM(embeddings, embedding_dim=8, bottom=(16, 8), top=(16, 1))
    dense, sparse = torch.randn(32, 13), torch.randint(0, 50, (32, 26))

    def gradients():
        model.zero_grad()
        logits = model(dense, sparse)
        logits.square().sum().backward()
        return logits.detach(), [p.grad.clone() for p in model.parameters()]

    ours = gradients()

    class Plain:
        @staticmethod
        def apply(vectors, upper, mirrored):
            return _plain_pairs(vectors)

    monkeypatch.setattr(dlrm, "_PairwiseDots", Plain)
    plain = gradients()
    assert torch.allclose(ours[0], plain[0], atol=1e-6)
    for mine, theirs in zip(ours[1], plain[1], strict=True):
        assert torch.allclose(mine, theirs, rtol=1e-4, atol=1e-6)
