"""Dummy vision pass: exactly zero effect, zero (not None) gradients."""

import pytest
import torch

from raggedvl.models import (
    FAMILIES,
    TinySizes,
    build_retriever,
    dummy_vision_inputs,
    install_dummy_vision,
    missing_modalities,
    vision_base_model,
)
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


# ------------------------------------------------------------------ generators (the SFT path) and the hook itself
def _generator_pair(family, expected):
    """The same tiny *ForConditionalGeneration twice (float64, training mode), one with the dummy pass."""
    from tests.batch.tiny_models import tiny_generator

    with_dummy, without = tiny_generator(family).double().train(), tiny_generator(family).double().train()
    install_dummy_vision(with_dummy, expected)
    return with_dummy, without


def _features(family, samples, **kw):
    from tests.batch.synth import make_features

    return make_features(samples, layout=family, labels=True, **kw)


def _lm_loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("family,samples", [
    ("qwen2_vl", [{"text": 4}, {"text": 6}]),
    ("qwen2_5_vl", [{"images": [(1, 2, 4)], "text": 3}]),  # images present, videos expected: a video dummy
    ("qwen3_vl", [{"text": 5}]),  # deepstack mergers reached by the dummy
])
def test_generator_dummy_has_zero_effect_and_reaches_every_vision_parameter(family, samples):
    with_dummy, without = _generator_pair(family, ("image", "video"))
    batch = {k: (v.double() if v.is_floating_point() else v) for k, v in _features(family, samples).items()}
    loss_d, grads_d = _lm_loss_and_grads(with_dummy, batch)
    loss_n, grads_n = _lm_loss_and_grads(without, batch)
    assert torch.equal(loss_d, loss_n)
    visual = [n for n in grads_d if ".visual." in n]
    assert visual
    for name, g in grads_d.items():
        if grads_n[name] is None:  # unused without the dummy: a zero tensor with it
            assert name in visual and g is not None and torch.count_nonzero(g) == 0, name
        else:
            assert torch.equal(g, grads_n[name]), name
    assert all(grads_d[n] is not None for n in visual)
    if family == "qwen3_vl":
        assert any("deepstack_merger_list" in n for n in visual)


def _count_calls(model):
    base = vision_base_model(model)
    calls = []
    base.visual.register_forward_pre_hook(lambda mod, args, kwargs: calls.append(("tower", tuple(args[0].shape))),
                                          with_kwargs=True)
    base.language_model.register_forward_pre_hook(lambda *_: calls.append(("decoder",)))
    return calls


def test_generator_calls_the_tower_once_per_expected_modality_before_the_decoder():
    model, _ = _generator_pair("qwen2_vl", ("image", "video"))
    calls = _count_calls(model)
    dummy = ("tower", (4, FAMILIES["qwen2_vl"].patch_dim))
    model(**_features("qwen2_vl", [{"images": [(1, 4, 4)]}]))
    assert calls == [dummy, ("tower", (16, 1176)), ("decoder",)]  # video dummy, real image, decoder
    calls.clear()
    feats = _features("qwen2_vl", [{"text": 3}])
    feats["pixel_values"] = torch.zeros(0, 1176)  # zero rows: no image, dropped before the model
    feats["image_grid_thw"] = torch.zeros(0, 3, dtype=torch.long)
    model(**feats)
    assert calls == [dummy, dummy, ("decoder",)]
    calls.clear()
    base = vision_base_model(model)
    base(feats["input_ids"], feats["attention_mask"])  # positional inputs
    assert calls == [dummy, dummy, ("decoder",)]
    calls.clear()
    embeds = base.get_input_embeddings()(feats["input_ids"]).detach()
    out = base(inputs_embeds=embeds, attention_mask=feats["attention_mask"])
    assert calls == [dummy, dummy, ("decoder",)] and out.last_hidden_state.requires_grad


def test_generation_runs_the_dummy_in_the_prefill_only():
    model, _ = _generator_pair("qwen2_vl", ("image",))
    model.eval()
    calls = _count_calls(model)
    feats = _features("qwen2_vl", [{"text": 3}])
    model.generate(input_ids=feats["input_ids"], attention_mask=feats["attention_mask"], max_new_tokens=3,
                   do_sample=False)
    assert [c[0] for c in calls].count("tower") == 1  # the prefill; decoding steps run no tower on any rank
    assert [c[0] for c in calls].count("decoder") == 3


def test_installing_again_replaces_the_expected_modalities_and_refuses_other_models():
    model, _ = _generator_pair("qwen2_vl", ("image", "video"))
    base = install_dummy_vision(model, ("image",))
    assert base is model.model and len(base._forward_pre_hooks) == 1
    calls = _count_calls(model)
    model(**_features("qwen2_vl", [{"text": 3}]))
    assert [c[0] for c in calls] == ["tower", "decoder"]
    with pytest.raises(ValueError, match="unknown"):
        install_dummy_vision(model, ("audio",))
    with pytest.raises(ValueError, match="holds no Qwen-VL base model"):
        install_dummy_vision(torch.nn.Linear(2, 2))
