"""Retriever: tiny build from a tokenizer, all three families, errors, LoRA, save/load, checkpointing."""

import warnings

import pytest
import torch

from raggedvl.models import FAMILIES, LoraSettings, Retriever, TinySizes, build_retriever, special_token_ids
from tests.models.helpers import make_batch, tiny_tokenizer

SMALL = TinySizes(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                  vision_depth=2, vision_embed_dim=32, vision_heads=2)


def _docs(family="qwen2_vl", **kw):
    return make_batch(["sample quantiles", "biplot of data", "R"], [[(1, 4, 4)], [(1, 2, 6), (1, 2, 2)], []],
                      patch_dim=FAMILIES[family].patch_dim, **kw)


def test_tiny_reads_vocab_and_special_ids_from_the_tokenizer():
    tok = tiny_tokenizer()
    model = build_retriever("tiny", processor=tok, tiny_sizes=SMALL, seed=0)
    cfg = model.base_model.config
    ids = special_token_ids(tok)
    assert cfg.text_config.vocab_size == len(tok) == ids["vocab_size"]
    for key in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        assert getattr(cfg, key) == tok.convert_tokens_to_ids(
            {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
             "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>"}[key])
    assert cfg.text_config.pad_token_id == tok.pad_token_id
    with pytest.raises(ValueError, match="needs processor"):
        build_retriever("tiny")


def test_tokenizer_without_vision_tokens_is_refused():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel()
    raw.train_from_iterator(["plain text"], trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>"], show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>")
    with pytest.raises(ValueError, match=r"<\|image_pad\|>"):
        build_retriever("tiny", processor=tok)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_late_interaction_output_per_family(family):
    model = build_retriever("tiny", processor=tiny_tokenizer(), tiny_family=family, tiny_sizes=SMALL, seed=0)
    batch = _docs(family, padding_side="left")
    out = model(**batch)
    B, L = batch["input_ids"].shape
    assert out.embeddings.shape == (B, L, 128)
    assert torch.equal(out.mask, batch["attention_mask"].bool())
    norms = out.embeddings.norm(dim=-1)
    assert torch.allclose(norms[out.mask], torch.ones_like(norms[out.mask]), atol=1e-5)
    assert torch.count_nonzero(out.embeddings[~out.mask]) == 0
    # a sample's embeddings do not depend on the other samples of the batch (no cross-sample mixing)
    alone = make_batch(["biplot of data"], [[(1, 2, 6), (1, 2, 2)]], patch_dim=FAMILIES[family].patch_dim)
    alone["pixel_values"] = batch["pixel_values"][16:32]  # sample 1's patch rows (sample 0 owns 16)
    single = model(**alone)
    assert torch.allclose(out.embeddings[1][out.mask[1]], single.embeddings[0][single.mask[0]], atol=1e-4)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_bi_encoder_gives_one_unit_vector_per_sample(pooling):
    model = build_retriever("tiny", processor=tiny_tokenizer(), head="bi_encoder", pooling=pooling, dim=32,
                            tiny_sizes=SMALL, seed=0)
    out = model(**_docs())
    assert out.embeddings.shape == (3, 32) and out.mask is None
    assert torch.allclose(out.embeddings.norm(dim=-1), torch.ones(3), atol=1e-5)


def test_forward_rejects_unknown_or_inconsistent_inputs():
    model = build_retriever("tiny", processor=tiny_tokenizer(), tiny_sizes=SMALL, seed=0)
    batch = _docs()
    with pytest.raises(TypeError, match="labels"):
        model(**batch, labels=batch["input_ids"])
    with pytest.raises(ValueError, match="given together"):
        model(**{k: v for k, v in batch.items() if k != "image_grid_thw"})
    with pytest.raises(TypeError, match="queries= and docs="):
        model(queries=batch)


def test_encode_pair_equals_two_separate_forwards():
    model = build_retriever("tiny", processor=tiny_tokenizer(), tiny_sizes=SMALL, seed=0)
    queries = make_batch(["sample quantiles", "biplot"], [[], []])
    docs = _docs()
    q, d = model.encode_pair(queries, docs)
    assert torch.equal(q.embeddings, model(**queries).embeddings)
    assert torch.equal(d.embeddings, model(**docs).embeddings)


def test_lora_trains_only_adapters_and_head():
    model = build_retriever("tiny", processor=tiny_tokenizer(), tiny_sizes=SMALL, seed=0,
                            lora=LoraSettings(r=4, alpha=8, dropout=0.0))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n or n.startswith("head.") for n in trainable)
    assert any(n.startswith("head.") for n in trainable)
    lora_names = [n for n in trainable if "lora_" in n]
    assert lora_names and all(".language_model." in n for n in lora_names)
    wrapped = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in lora_names}
    assert wrapped == set(LoraSettings().target_modules)
    out = model(**_docs())
    out.embeddings.sum().backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad)
    with pytest.raises(ValueError, match="match no Linear"):
        build_retriever("tiny", processor=tiny_tokenizer(), tiny_sizes=SMALL, lora=LoraSettings(target_modules=("qkv",)))


@pytest.mark.parametrize("lora", [None, LoraSettings(r=4, alpha=8, dropout=0.0)])
def test_save_load_round_trip(tmp_path, lora):
    model = build_retriever("tiny", processor=tiny_tokenizer(), tiny_sizes=SMALL, seed=0, lora=lora, dim=64)
    with torch.no_grad():  # move every weight away from its init so a silent re-init would show
        for p in model.parameters():
            p.add_(0.01)
    model.save_pretrained(tmp_path)
    assert sorted(f.name for f in tmp_path.iterdir()) == ["raggedvl_retriever.json", "raggedvl_retriever.safetensors"]
    for loaded in (Retriever.from_pretrained(tmp_path), build_retriever(str(tmp_path))):
        assert loaded.config == model.config
        assert loaded.state_dict().keys() == model.state_dict().keys()
        assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())
        assert torch.equal(loaded(**_docs()).embeddings, model(**_docs()).embeddings)
    assert build_retriever(str(tmp_path), head="late_interaction", dim=64, lora=lora).config == model.config
    with pytest.raises(ValueError, match="dim=32"):
        build_retriever(str(tmp_path), dim=32)
    (tmp_path / "raggedvl_retriever.json").write_text('{"format": "something-else"}')
    with pytest.raises(ValueError, match="not a raggedvl retriever"):
        Retriever.from_pretrained(tmp_path)


def test_gradient_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    plain = build_retriever("tiny", processor=tiny_tokenizer(), tiny_sizes=SMALL, seed=0).double()
    ckpt = build_retriever("tiny", processor=tiny_tokenizer(), tiny_sizes=SMALL, seed=0,
                           gradient_checkpointing=True).double()
    ckpt.load_state_dict(plain.state_dict())
    assert ckpt.base_model.is_activation_checkpointing and not plain.base_model.is_activation_checkpointing
    grads = []
    for model in (plain, ckpt):
        model.train()
        out = model(**_docs(dtype=torch.float64))
        (out.embeddings * torch.linspace(-1, 1, 128, dtype=torch.float64)).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        assert torch.allclose(g, grads[1][name], atol=1e-10), name


def test_flash_attention_request_falls_back_with_a_warning_on_cpu():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = build_retriever("tiny", processor=tiny_tokenizer(), tiny_sizes=SMALL,
                                attn_implementation="flash_attention_2")
    if torch.cuda.is_available():
        pytest.skip("CUDA present: flash-attn may be genuinely available")
    assert any("flash_attention_2" in str(w.message) for w in caught)
    assert model.base_model.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="attn_implementation"):
        build_retriever("tiny", processor=tiny_tokenizer(), attn_implementation="fast")


def test_parameter_groups_split_backbone_and_head_and_skip_frozen():
    model = build_retriever("tiny", processor=tiny_tokenizer(), tiny_sizes=SMALL, seed=0,
                            lora=LoraSettings(r=4, alpha=8, dropout=0.0))
    groups = model.parameter_groups(lr=2e-4, head_lr=2e-3)
    assert [(g["name"], g["lr"]) for g in groups] == [("backbone", 2e-4), ("head", 2e-3)]
    ids = [id(p) for g in groups for p in g["params"]]
    assert sorted(ids) == sorted(id(p) for p in model.parameters() if p.requires_grad)
    torch.optim.AdamW(groups)  # accepted as is
    with pytest.raises(ValueError, match="learning rates"):
        model.parameter_groups(lr=0.0)


def test_the_tiny_preset_builds_its_initialisation():
    std = TinySizes().initializer_range
    model = build_retriever("tiny", processor=tiny_tokenizer(), seed=0)
    assert model.base_model.config.text_config.initializer_range == std
    assert model.base_model.config.vision_config.initializer_range == std
