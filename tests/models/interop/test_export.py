"""Export to colpali-engine and transformers layouts, loaded back by those libraries' own code
paths (transformers' ColQwen2ForRetrieval and peft in-process; colpali-engine's ColQwen2 is a
Qwen2VLModel plus ``custom_text_proj``, whose parameter layout a two-line stand-in reproduces
for peft) and by raggedvl: weights round-trip exactly, embeddings agree."""

import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from transformers import ColQwen2ForRetrieval, Qwen2VLModel

from raggedvl.data import RetrievalCollator, build_processor
from raggedvl.models import build_retriever
from raggedvl.models.interop.export import export_colpali, export_transformers
from tests.models.interop.helpers import FULL, LORA, encode, examples, masked_max_abs, reference
from tests.models.interop.test_hf_colqwen2 import hf_embeddings, save_tiny_colqwen2

TOL = 1e-5


class ColQwen2Layout(Qwen2VLModel):
    """colpali-engine's ColQwen2 parameter layout: the base model plus a 128-d custom_text_proj."""

    def __init__(self, config):
        super().__init__(config)
        self.custom_text_proj = nn.Linear(config.text_config.hidden_size, 128)
        self.post_init()


def colqwen2_embeddings(model, batch):
    """colpali-engine's ColQwen2.forward on a raggedvl batch: last hidden state, custom_text_proj,
    L2 normalisation per token, times the attention mask."""
    with torch.no_grad():
        hidden = model(**batch.to_dict(), use_cache=False).last_hidden_state
        proj = model.custom_text_proj(hidden)
    return proj / proj.norm(dim=-1, keepdim=True) * batch["attention_mask"].unsqueeze(-1)


def _same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k].float(), b[k].float()) for k in a)


def test_raggedvl_to_transformers_to_raggedvl_is_exact(tmp_path):
    model = build_retriever(str(FULL))
    export_transformers(model, build_processor(str(FULL)), tmp_path / "hf")
    hf_model, info = ColQwen2ForRetrieval.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    batch = RetrievalCollator(build_processor(str(tmp_path / "hf")), prompts=model.config.prompts)(examples())
    model.eval()
    with torch.no_grad():
        docs, queries = model(**batch["docs"]), model(**batch["queries"])
    d_err = masked_max_abs(hf_embeddings(hf_model.eval(), batch["docs"]), docs.embeddings, docs.mask)
    q_err = masked_max_abs(hf_embeddings(hf_model, batch["queries"]), queries.embeddings, queries.mask)
    back = build_retriever(str(tmp_path / "hf"))
    print(f"raggedvl -> transformers: max |doc diff| {d_err:.2e}, |query diff| {q_err:.2e}")
    assert d_err <= TOL and q_err <= TOL
    _same_state(back.state_dict(), model.state_dict())
    assert back.config.prompts == model.config.prompts  # raggedvl_prompts.json


def test_transformers_to_raggedvl_to_transformers_is_exact(tmp_path):
    save_tiny_colqwen2(tmp_path / "src")
    model = build_retriever(str(tmp_path / "src"))
    export_transformers(model, build_processor(str(tmp_path / "src")), tmp_path / "again")
    _same_state(load_file(str(tmp_path / "again" / "model.safetensors")), load_file(str(tmp_path / "src" / "model.safetensors")))
    src, again = (json.loads((tmp_path / d / "config.json").read_text()) for d in ("src", "again"))
    assert again["embedding_dim"] == src["embedding_dim"] and again["vlm_config"]["text_config"] == src["vlm_config"]["text_config"]


def test_colpali_full_export_is_the_fixture_layout_and_reloads_with_its_embeddings(tmp_path):
    model = build_retriever(str(FULL))
    export_colpali(model, build_processor(str(FULL)), tmp_path / "col")
    _same_state(load_file(str(tmp_path / "col" / "model.safetensors")), load_file(str(FULL / "model.safetensors")))
    config = json.loads((tmp_path / "col" / "config.json").read_text())
    assert config["architectures"] == ["ColQwen2"] and config["model_type"] == "qwen2_vl"
    processor_config = json.loads((tmp_path / "col" / "processor_config.json").read_text())
    assert processor_config["processor_class"] == "ColQwen2Processor" and "video_processor" in processor_config
    loaded, info = ColQwen2Layout.from_pretrained(tmp_path / "col", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    ref = reference()
    _, q, d = encode(build_retriever(str(tmp_path / "col")), tmp_path / "col")
    assert masked_max_abs(d.embeddings, ref["full.doc_embeddings"], d.mask) <= TOL
    assert masked_max_abs(q.embeddings, ref["full.query_embeddings"], q.mask) <= TOL


def test_colpali_adapter_export_loads_with_peft_on_its_base(tmp_path):
    from peft import PeftModel

    model = build_retriever(str(LORA))  # kept as a trainable adapter
    assert model.config.base == str(FULL.resolve())
    export_colpali(model, build_processor(str(LORA)), tmp_path / "adapter")
    adapter_config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(FULL.resolve())
    assert adapter_config["modules_to_save"] == ["custom_text_proj"] and adapter_config["r"] == 8
    saved = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    fixture = load_file(str(LORA / "adapter_model.safetensors"))
    lm = {k: v for k, v in fixture.items() if "custom_text_proj" not in k}
    assert all(torch.equal(saved[k], v) for k, v in lm.items())  # the language model's LoRA, unchanged
    batch, _, ours = encode(model, LORA)
    for loaded in (
        PeftModel.from_pretrained(ColQwen2Layout.from_pretrained(FULL), tmp_path / "adapter"),
        ColQwen2Layout.from_pretrained(tmp_path / "adapter"),  # transformers' peft integration, as colpali users load
    ):
        err = masked_max_abs(colqwen2_embeddings(loaded.eval(), batch["docs"]), ours.embeddings, ours.mask)
        print(f"raggedvl adapter -> peft on the colpali base: max |doc diff| {err:.2e}")
        assert err <= TOL
    again = build_retriever(str(tmp_path / "adapter"))  # and raggedvl reads its own export back
    _, q, d = encode(again, tmp_path / "adapter")
    ref = reference()
    assert masked_max_abs(d.embeddings, ref["lora.doc_embeddings"], d.mask) <= TOL


def test_what_colpali_cannot_hold_is_refused_before_writing(tmp_path):
    from tests.models.helpers import tiny_tokenizer

    from raggedvl.models import LoraSettings, TinySizes

    sizes = TinySizes(hidden_size=64, num_layers=1, intermediate_size=64, vision_depth=1, vision_embed_dim=32, vision_heads=2)
    wide = build_retriever("tiny", processor=tiny_tokenizer(), tiny_sizes=sizes, dim=96)
    with pytest.raises(ValueError, match=r"96 dimensions.*fixes its projection.*at 128.*--format transformers"):
        export_colpali(wide, None, tmp_path / "wide")
    bi = build_retriever("tiny", processor=tiny_tokenizer(), tiny_sizes=sizes, head="bi_encoder")
    with pytest.raises(ValueError, match="bi_encoder retriever cannot be exported"):
        export_colpali(bi, None, tmp_path / "bi")
    assert not (tmp_path / "wide").exists() and not (tmp_path / "bi").exists()
    tiny_lora = build_retriever("tiny", processor=tiny_tokenizer(), tiny_sizes=sizes, lora=LoraSettings(r=2, alpha=2))
    with pytest.raises(ValueError, match="--merge-lora"):
        export_colpali(tiny_lora, None, tmp_path / "adapter")
