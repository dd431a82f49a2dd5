"""Retrieval heads: shapes, masking, normalisation and pooling, against direct formulas."""

import pytest
import torch
import torch.nn.functional as F

from raggedvl.models import RetrievalHead, pool_hidden


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(3, 5, 16, generator=gen, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [0, 0, 1, 1, 1]], dtype=torch.long)
    return hidden, mask


def test_late_interaction_shapes_mask_and_unit_norm():
    hidden, mask = _inputs()
    head = RetrievalHead(16, dim=8, head="late_interaction", pooling="last", eps=1e-6).double()
    out = head(hidden, mask)
    assert out.embeddings.shape == (3, 5, 8) and out.mask.dtype == torch.bool
    assert torch.equal(out.mask, mask.bool())
    norms = out.embeddings.norm(dim=-1)
    assert torch.allclose(norms[mask.bool()], torch.ones(int(mask.sum()), dtype=norms.dtype), atol=1e-6)
    assert torch.count_nonzero(out.embeddings[~mask.bool()]) == 0
    expected = F.normalize(head.proj(hidden), dim=-1)
    assert out.embeddings.dtype == torch.float64
    assert torch.allclose(out.embeddings[mask.bool()], expected[mask.bool()], atol=1e-12)


def test_late_interaction_eps_keeps_zero_vectors_finite():
    head = RetrievalHead(4, dim=3, head="late_interaction", pooling="last", eps=1e-6)
    with torch.no_grad():
        head.proj.weight.zero_(), head.proj.bias.zero_()
    hidden = torch.randn(1, 2, 4, requires_grad=True)
    out = head(hidden, torch.ones(1, 2))
    out.embeddings.sum().backward()
    assert torch.isfinite(hidden.grad).all() and torch.isfinite(head.proj.weight.grad).all()
    assert torch.count_nonzero(out.embeddings) == 0


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_bi_encoder_pooling_left_and_right_padding(pooling):
    hidden, mask = _inputs(1)
    pooled = pool_hidden(hidden, mask.bool(), pooling)
    for b in range(3):
        real = hidden[b, mask[b].bool()]
        want = real[-1] if pooling == "last" else real.mean(0)
        assert torch.allclose(pooled[b], want)
    head = RetrievalHead(16, dim=8, head="bi_encoder", pooling=pooling, eps=1e-6).double()
    out = head(hidden, mask)
    assert out.embeddings.shape == (3, 8) and out.mask is None
    assert torch.allclose(out.embeddings, F.normalize(head.proj(pooled), dim=-1), atol=1e-12)


def test_bad_settings_and_empty_rows_are_rejected():
    with pytest.raises(ValueError, match="head must be one of"):
        RetrievalHead(4, 8, "colbert", "last", 1e-6)
    with pytest.raises(ValueError, match="pooling must be one of"):
        RetrievalHead(4, 8, "late_interaction", "cls", 1e-6)
    with pytest.raises(ValueError, match=r"samples \[1\]"):
        pool_hidden(torch.zeros(2, 3, 4), torch.tensor([[1, 0, 0], [0, 0, 0]]).bool(), "last")
