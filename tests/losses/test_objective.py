"""``make_retrieval_loss``: one call signature on embedding outputs for every loss, checked
against the naive float64 references."""

import typing

import pytest
import torch

from raggedvl.losses import LOSS_NAMES, InfoNCELoss, RetrievalLoss, make_retrieval_loss
from raggedvl.models import EmbeddingOutput
from raggedvl.app.config import TrainConfig
from tests.losses import reference as ref
from tests.losses.test_losses_math import _bi, _mv


@pytest.mark.parametrize("k", [0, 2])
def test_each_loss_on_embedding_outputs_equals_its_reference(k):
    q, qm, d, dm, negs, nm = _mv(3 + k, k=k)
    q.requires_grad_(True)
    neg_out = EmbeddingOutput(negs, nm) if k else None
    queries, docs = EmbeddingOutput(q, qm), EmbeddingOutput(d, dm)

    late = make_retrieval_loss("late_interaction", temperature=0.05)(queries, docs, neg_out)
    expected = ref.late_interaction(q, qm, d, dm, negs, nm, temperature=0.05)
    torch.testing.assert_close(late, expected, rtol=1e-12, atol=1e-12)
    (grad,) = torch.autograd.grad(late, q)
    (expected_grad,) = torch.autograd.grad(expected, q)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-10, atol=1e-12)

    pair = make_retrieval_loss("pairwise")(queries, docs, neg_out)
    torch.testing.assert_close(pair, ref.pairwise(q, qm, d, dm, negs, nm), rtol=1e-12, atol=1e-12)

    bq, bd, bnegs = _bi(7 + k, k=k)
    bi = make_retrieval_loss("infonce", temperature=0.1)(
        EmbeddingOutput(bq), EmbeddingOutput(bd), EmbeddingOutput(bnegs) if k else None)
    torch.testing.assert_close(bi, ref.info_nce(bq, bd, bnegs, scale=10.0), rtol=1e-12, atol=1e-12)


def test_options_reach_the_loss_module():
    loss = make_retrieval_loss("infonce", temperature=0.1, symmetric=True, gather_across_ranks=False)
    assert isinstance(loss.loss, InfoNCELoss) and loss.loss.symmetric and not loss.loss.gather_across_ranks
    bq, bd, _ = _bi(1)
    torch.testing.assert_close(loss(EmbeddingOutput(bq), EmbeddingOutput(bd)),
                               ref.info_nce(bq, bd, scale=10.0, symmetric=True), rtol=1e-12, atol=1e-12)


def test_mismatched_outputs_and_names_are_refused():
    bq, bd, _ = _bi(2)
    with pytest.raises(ValueError, match="needs multi-vector queries .* use loss 'infonce' with a bi-encoder head"):
        make_retrieval_loss("late_interaction")(EmbeddingOutput(bq), EmbeddingOutput(bd))
    with pytest.raises(ValueError, match="unknown loss 'colbert'"):
        make_retrieval_loss("colbert")
    with pytest.raises(TypeError, match="got MSELoss"):
        RetrievalLoss(torch.nn.MSELoss())


def test_the_config_offers_exactly_the_losses_there_are():
    assert typing.get_args(typing.get_type_hints(TrainConfig)["loss"]) == LOSS_NAMES
