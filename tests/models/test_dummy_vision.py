"""Dummy vision pass (issue 7 item 1, case C04): exactly zero effect, zero (not None) gradients."""

import pytest
import torch

from raggedvl.models import FAMILIES, TinySizes, build_retriever, dummy_vision_inputs, missing_modalities
from tests.models.helpers import make_batch, tiny_tokenizer

SMALL = TinySizes(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                  vision_depth=2, vision_embed_dim=32, vision_heads=2)
WEIGHTS = torch.linspace(-1.0, 1.0, 128, dtype=torch.float64)


def _pair(family, expected, checkpointing=False):
    with_dummy = build_retriever("tiny", processor=tiny_tokenizer(), tiny_family=family, tiny_sizes=SMALL, seed=0,
                                 expected_modalities=expected, gradient_checkpointing=checkpointing).double()
    without = build_retriever("tiny", processor=tiny_tokenizer(), tiny_family=family, tiny_sizes=SMALL, seed=0,
                              expected_modalities=(), gradient_checkpointing=checkpointing).double()
    without.load_state_dict(with_dummy.state_dict())
    return with_dummy, without


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    loss = (out.embeddings * WEIGHTS).sum()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("family,checkpointing", [("qwen2_vl", False), ("qwen2_vl", True),
                                                  ("qwen2_5_vl", False), ("qwen3_vl", True)])
def test_text_only_batch_dummy_has_zero_effect(family, checkpointing):
    with_dummy, without = _pair(family, ("image", "video"), checkpointing)
    text_only = make_batch(["sample quantiles", "an introduction to R"], [[], []])
    loss_d, grads_d = _loss_and_grads(with_dummy, text_only)
    loss_n, grads_n = _loss_and_grads(without, text_only)
    assert torch.equal(loss_d, loss_n)
    visual = [n for n in grads_d if ".visual." in n or n.startswith("backbone.visual.")]
    assert visual, "the tiny backbone has a vision tower"
    for name, g in grads_d.items():
        if name in visual:
            assert g is not None and torch.count_nonzero(g) == 0, name  # zero, not None
            assert grads_n[name] is None  # without the dummy DDP would see an unused parameter
        else:
            assert torch.equal(g, grads_n[name]), name
    if family == "qwen3_vl":  # deepstack mergers are reached by the dummy too
        assert any("deepstack_merger_list" in n for n in visual)


def test_image_batch_runs_no_image_dummy_but_a_video_dummy_when_videos_are_expected():
    calls = []
    model = build_retriever("tiny", processor=tiny_tokenizer(), tiny_sizes=SMALL, seed=0,
                            expected_modalities=("image", "video"))
    model.base_model.visual.register_forward_hook(lambda mod, args, out: calls.append(tuple(args[0].shape)))
    docs = make_batch(["biplot"], [[(1, 4, 4)]])
    model(**docs)
    pixels, grid = dummy_vision_inputs(model.base_model.visual)
    assert calls == [tuple(pixels.shape), (16, 1176)]  # one dummy for video, then the real image
    assert grid.tolist() == [[1, 2, 2]] and pixels.shape == (4, FAMILIES["qwen2_vl"].patch_dim)
    calls.clear()
    model(**make_batch(["x"], [[]]))
    assert len(calls) == 2  # text-only: dummy image + dummy video, the same count as above
    assert missing_modalities(docs, ("image", "video")) == ["video"]
    with pytest.raises(ValueError, match="unknown vision modality"):
        missing_modalities(docs, ("audio",))


def test_images_batch_is_unchanged_by_the_dummy_machinery():
    with_dummy, without = _pair("qwen2_vl", ("image",))
    docs = make_batch(["biplot", "quantiles"], [[(1, 4, 4)], [(1, 2, 2)]], dtype=torch.float64)
    loss_d, grads_d = _loss_and_grads(with_dummy, docs)
    loss_n, grads_n = _loss_and_grads(without, docs)
    assert torch.equal(loss_d, loss_n)
    assert all(torch.equal(g, grads_n[n]) for n, g in grads_d.items())
