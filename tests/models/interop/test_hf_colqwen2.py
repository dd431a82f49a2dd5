"""transformers' ColQwen2ForRetrieval <-> raggedvl, in-process (it imports without torchvision).

A tiny ColQwen2ForRetrieval is built from a config, saved with its ColQwen2Processor, loaded by
raggedvl, and both encode the same inputs: raggedvl's collator reproduces the processor's token
ids, and the embeddings agree on every real token once transformers' model gets the M-RoPE
position ids (without them its document embeddings differ: it calls its VLM with
``input_ids=None``).
"""

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer, ColQwen2Config, ColQwen2ForRetrieval, ColQwen2Processor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from raggedvl.data import RetrievalCollator, build_processor
from raggedvl.models import build_retriever
from raggedvl.models.interop import mrope_position_ids
from tests.models.interop.helpers import FULL, examples, masked_max_abs

TOL = 1e-5


def save_tiny_colqwen2(folder, embedding_dim=96, seed=0):
    """A random tiny ColQwen2ForRetrieval (the fixture's Qwen2-VL config and tokenizer) and its
    ColQwen2Processor, saved with transformers' own ``save_pretrained``."""
    torch.manual_seed(seed)
    config = ColQwen2Config(vlm_config=AutoConfig.from_pretrained(FULL).to_dict(), embedding_dim=embedding_dim)
    model = ColQwen2ForRetrieval(config).eval()
    model.save_pretrained(folder)
    processor = ColQwen2Processor(image_processor=Qwen2VLImageProcessorPil.from_pretrained(FULL),
                                  tokenizer=AutoTokenizer.from_pretrained(FULL))
    processor.save_pretrained(folder)
    return model, processor


def hf_embeddings(model, features):
    """ColQwen2ForRetrieval's embeddings of a raggedvl batch (padded pixel layout), with the
    M-RoPE position ids."""
    inputs = features.to_padded()
    with torch.no_grad():
        return model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                     pixel_values=inputs.get("pixel_values"), image_grid_thw=inputs.get("image_grid_thw"),
                     position_ids=mrope_position_ids(model.vlm, inputs)).embeddings


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("colqwen2-hf")
    model, processor = save_tiny_colqwen2(folder)
    return folder, model, processor


def test_transformers_checkpoint_loads_with_its_token_ids_and_embeddings(saved):
    folder, hf_model, hf_processor = saved
    retriever = build_retriever(str(folder)).eval()
    assert retriever.config.dim == 96
    batch = RetrievalCollator(build_processor(str(folder)), prompts=retriever.config.prompts)(examples())
    queries = [e["query"] for e in examples()]
    assert torch.equal(batch["queries"]["input_ids"], hf_processor(text=queries)["input_ids"])
    images = [e["image"].convert("RGB") for e in examples()]
    hf_docs = hf_processor(images=images)
    assert torch.equal(batch["docs"]["input_ids"], hf_docs["input_ids"])
    with torch.no_grad():
        q, d = retriever(**batch["queries"]), retriever(**batch["docs"])
    q_err = masked_max_abs(q.embeddings, hf_embeddings(hf_model, batch["queries"]), q.mask)
    d_err = masked_max_abs(d.embeddings, hf_embeddings(hf_model, batch["docs"]), d.mask)
    print(f"transformers -> raggedvl: max |query diff| {q_err:.2e}, |doc diff| {d_err:.2e}")
    assert q_err <= TOL and d_err <= TOL


def test_without_mrope_position_ids_transformers_documents_differ(saved):
    folder, hf_model, _ = saved
    retriever = build_retriever(str(folder)).eval()
    batch = RetrievalCollator(build_processor(str(folder)), prompts=retriever.config.prompts)(examples())
    inputs = batch["docs"].to_padded()
    with torch.no_grad():
        plain = hf_model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                         pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"]).embeddings
        ours = retriever(**batch["docs"])
    assert masked_max_abs(plain, ours.embeddings, ours.mask) > 1e-3  # why the position ids are needed


def test_missing_or_misshapen_projection_is_named(saved, tmp_path):
    from safetensors.torch import load_file, save_file

    folder, _, _ = saved
    for case, edit, pattern in [
        ("gone", lambda t: [t.pop(k) for k in ("embedding_proj_layer.weight", "embedding_proj_layer.bias")],
         r"gone/model\.safetensors has no 'embedding_proj_layer\.weight'"),
        ("dim", lambda t: t.update({"embedding_proj_layer.weight": torch.zeros(128, 64)}),
         r"dim/model\.safetensors: tensor 'embedding_proj_layer\.weight' has shape \[128, 64\].*embedding_dim 96"),
    ]:
        target = tmp_path / case
        target.mkdir()
        for p in folder.iterdir():
            (target / p.name).write_bytes(p.read_bytes())
        tensors = load_file(str(target / "model.safetensors"))
        edit(tensors)
        save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(ValueError, match=pattern):
            build_retriever(str(target))
