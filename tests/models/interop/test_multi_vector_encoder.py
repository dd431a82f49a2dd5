"""sentence-transformers' MultiVectorEncoder <-> raggedvl, in-process.

A retriever is exported with ``export_multi_vector_encoder`` and loaded by sentence-transformers'
own ``MultiVectorEncoder(DIR)`` (its module list, prompts, chat template and similarity from the
folder); ``encode_query`` / ``encode_document`` are compared with raggedvl's forward on the
same queries and pages. sentence-transformers loads the processor with ``AutoProcessor``, whose
``Qwen2VLProcessor`` needs torchvision for its video processor; where torchvision is missing
(these machines) the ``sentence_transformers_processor`` fixture hands it raggedvl's
``Qwen2VLProcessor`` subclass without videos (same text and image behaviour) built from the same
folder. Everything else is sentence-transformers' code.

Error model: the same token ids and pixel values go through the same float32 operations on one
CPU (the backbone's patch embedding as a matrix product in raggedvl, a Conv3d in the loaded
base model), so embeddings agree to float32 rounding (<= 1e-5 per entry, as for
transformers' ColQwen2ForRetrieval); a MaxSim score sums at most ~20 such terms (<= 1e-4).
"""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from raggedvl.data import RetrievalCollator, build_processor
from raggedvl.losses.scoring import late_interaction_scores
from raggedvl.models import LoraSettings, build_retriever
from raggedvl.models.interop import check_checkpoint, checkpoint_kind
from raggedvl.models.interop.multi_vector_encoder import export_multi_vector_encoder
from raggedvl.prompts import RetrievalPrompts, transformers_colqwen2_prompts
from tests.models.interop.helpers import FULL, LORA, examples

pytest.importorskip("sentence_transformers")
from sentence_transformers import MultiVectorEncoder  # noqa: E402

TOL = 1e-5
SCORE_TOL = 1e-4


@pytest.fixture
def sentence_transformers_processor(monkeypatch):
    """sentence-transformers' AutoProcessor, or raggedvl's torchvision-free processor of the same
    folder where torchvision is missing (module docstring)."""
    import importlib.util

    import sentence_transformers.base.modules.transformer as st_transformer

    if importlib.util.find_spec("torchvision") is None:
        class _PilProcessor:
            @staticmethod
            def from_pretrained(path, **_):
                return build_processor(str(path))

        monkeypatch.setattr(st_transformer, "AutoProcessor", _PilProcessor)


def _encode_both(retriever, folder):
    """(raggedvl's query and page outputs, the collated batch, the loaded encoder,
    sentence-transformers' query and page embeddings: lists of [tokens, D], the pages as
    raggedvl's image policy prepares them) for the fixture inputs."""
    collator = RetrievalCollator(build_processor(str(folder)), prompts=retriever.config.prompts)
    batch = collator(examples())
    retriever.eval()
    with torch.no_grad():
        queries, pages = retriever(**batch["queries"]), retriever(**batch["docs"])
    encoder = MultiVectorEncoder(str(folder), local_files_only=True)
    prepared = [collator.image_policy.prepare(e["image"], name=e["id"]) for e in examples()]
    st_queries = encoder.encode_query([e["query"] for e in examples()])
    st_pages = encoder.encode_document(prepared)
    return queries, pages, batch, encoder, st_queries, st_pages, prepared


def _max_diff(ours, theirs) -> float:
    """Largest |difference| over the real tokens; the rows must keep the same tokens."""
    assert [int(n) for n in ours.mask.sum(1)] == [t.shape[0] for t in theirs]
    return max(float((ours.embeddings[i][ours.mask[i]] - t).abs().max()) for i, t in enumerate(theirs))


@pytest.mark.parametrize("prompts", [
    None,  # the fixture's own: colpali's, left padding
    transformers_colqwen2_prompts(query_prefix="Query: ", visual_prompt_prefix="<|im_start|>user\n<|vision_start|>"
                                  "<|image_pad|><|vision_end|>Describe the page, \"quoted\" {x}.<|im_end|>\n",
                                  pad_token="<|endoftext|>", padding_side="right"),
], ids=["colpali-prompts", "prefix-newline-right-padding"])
def test_multi_vector_encoder_embeds_and_scores_as_raggedvl(tmp_path, prompts, sentence_transformers_processor):
    retriever = build_retriever(str(FULL))
    if prompts is not None:
        retriever.config.prompts = prompts
    export_multi_vector_encoder(retriever, build_processor(str(FULL)), tmp_path / "st")
    saved = json.loads((tmp_path / "st" / "config_sentence_transformers.json").read_text())
    p = retriever.config.prompts
    assert saved["prompts"] == {"query": p.query_prefix, "document": p.doc_template.split("<|vision_start|>")[0]}
    assert saved["similarity_fn_name"] == "maxsim"
    assert json.loads((tmp_path / "st" / "processor_config.json").read_text())["processor_class"] == "Qwen2VLProcessor"

    queries, pages, batch, encoder, st_queries, st_pages, prepared = _encode_both(retriever, tmp_path / "st")
    assert encoder.similarity_fn_name == "maxsim" and encoder.prompts == saved["prompts"]
    for task, ours, inputs in (("query", batch["queries"], [e["query"] for e in examples()]),
                               ("document", batch["docs"], prepared)):
        features = encoder[0].preprocess(inputs, prompt=encoder.prompts[task], task=task)
        real = ours["attention_mask"].bool()
        assert torch.equal(features["attention_mask"].bool(), real)  # the same tokens, the same padding side
        assert torch.equal(features["input_ids"][real], ours["input_ids"][real])
    assert torch.equal(features["pixel_values"], batch["docs"]["pixel_values"])
    q_err, d_err = _max_diff(queries, st_queries), _max_diff(pages, st_pages)
    print(f"MultiVectorEncoder vs raggedvl: max |query diff| {q_err:.2e}, |page diff| {d_err:.2e}")
    assert q_err <= TOL and d_err <= TOL
    ours = late_interaction_scores(queries.embeddings, queries.mask, pages.embeddings, pages.mask)
    theirs = encoder.similarity(st_queries, st_pages)
    assert torch.allclose(theirs.to(ours.dtype), ours, atol=SCORE_TOL, rtol=0)
    assert torch.equal(theirs.argmax(dim=1), ours.argmax(dim=1))


def test_raggedvl_to_sentence_transformers_to_raggedvl_is_exact(tmp_path):
    model = build_retriever(str(FULL))
    export_multi_vector_encoder(model, build_processor(str(FULL)), tmp_path / "st")
    assert checkpoint_kind(tmp_path / "st") == "sentence_transformers"
    back = build_retriever(str(tmp_path / "st"))
    assert back.state_dict().keys() == model.state_dict().keys()
    assert all(torch.equal(back.state_dict()[k], v) for k, v in model.state_dict().items())
    assert back.config.prompts == model.config.prompts and back.config.dim == model.config.dim
    # without raggedvl_prompts.json the prompts come back from sentence-transformers' prompts and the chat template
    (tmp_path / "st" / "raggedvl_prompts.json").unlink()
    assert build_retriever(str(tmp_path / "st")).config.prompts == model.config.prompts
    # and again: the second export writes the same weights
    export_multi_vector_encoder(back, build_processor(str(tmp_path / "st")), tmp_path / "again")
    for name in ("model.safetensors", "1_Dense/model.safetensors"):
        first, second = (load_file(str(tmp_path / d / name)) for d in ("st", "again"))
        assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def test_lora_retrievers_export_merged_and_train_with_fresh_lora_from_the_folder(tmp_path, sentence_transformers_processor):
    adapter = build_retriever(str(LORA))  # a colpali adapter: LoRA on the language model
    notes = export_multi_vector_encoder(adapter, build_processor(str(LORA)), tmp_path / "st")
    assert adapter.config.lora is None and any("merged" in n for n in notes)
    queries, pages, _, _, st_queries, st_pages, _ = _encode_both(adapter, tmp_path / "st")
    assert _max_diff(queries, st_queries) <= TOL and _max_diff(pages, st_pages) <= TOL
    fresh = build_retriever(str(tmp_path / "st"), lora=LoraSettings(r=2, alpha=4))
    assert fresh.config.lora is not None and fresh.config.base == str((tmp_path / "st").resolve())
    trainable = {n for n, p in fresh.named_parameters() if p.requires_grad}
    assert any("lora_A" in n for n in trainable) and "head.proj.weight" in trainable
    assert not any(n.startswith("backbone.") and "lora_" not in n for n in trainable)  # the base stays frozen


def test_what_the_folder_cannot_hold_or_raggedvl_cannot_read_is_named(tmp_path):
    from tests.models.helpers import tiny_tokenizer

    from raggedvl.models import TinySizes

    sizes = TinySizes(hidden_size=64, num_layers=1, intermediate_size=64, vision_depth=1, vision_embed_dim=32, vision_heads=2)
    bi = build_retriever("tiny", processor=tiny_tokenizer(), tiny_sizes=sizes, head="bi_encoder")
    with pytest.raises(ValueError, match="bi_encoder retriever cannot be exported as sentence-transformers"):
        export_multi_vector_encoder(bi, None, tmp_path / "bi")
    assert not (tmp_path / "bi").exists()
    export_multi_vector_encoder(build_retriever(str(FULL)), build_processor(str(FULL)), tmp_path / "st")
    other = tmp_path / "other"
    shutil.copytree(tmp_path / "st", other)
    modules = json.loads((other / "modules.json").read_text())
    (other / "modules.json").write_text(json.dumps(modules[:2] + modules[3:]))  # no MultiVectorMask
    with pytest.raises(ValueError, match=r"modules\.json lists .*raggedvl loads the late-interaction pipeline"):
        build_retriever(str(other))
    dense = load_file(str(tmp_path / "st" / "1_Dense" / "model.safetensors"))
    from safetensors.torch import save_file

    save_file({"linear.weight": dense["linear.weight"][:, :32].contiguous(), "linear.bias": dense["linear.bias"]},
              str(tmp_path / "st" / "1_Dense" / "model.safetensors"))
    for load in (build_retriever, check_checkpoint):  # check_checkpoint: raggedvl train's preflight, headers only
        with pytest.raises(ValueError, match=r"1_Dense.*'linear\.weight' is \[128, 32\].*needs \[128, 64\]"):
            load(str(tmp_path / "st"))


def test_retrieval_prompts_round_trip_through_the_chat_template():
    from transformers import AutoTokenizer

    from raggedvl.models.interop.multi_vector_encoder import chat_template, st_prompts

    tokenizer = AutoTokenizer.from_pretrained(FULL)
    prompts = RetrievalPrompts(query_template='Q {"a"}\\n\n: {query}<|endoftext|>\n',
                               doc_template="é\n<|vision_start|><|image_pad|><|vision_end|>{{ tail }}\n")
    template, st = chat_template(prompts), st_prompts(prompts)
    query = tokenizer.apply_chat_template(
        [{"role": "system", "content": [{"type": "text", "text": st["query"]}]},
         {"role": "user", "content": [{"type": "text", "text": "what is R"}]}], tokenize=False, chat_template=template)
    page = tokenizer.apply_chat_template(
        [{"role": "system", "content": [{"type": "text", "text": st["document"]}]},
         {"role": "user", "content": [{"type": "image"}]}], tokenize=False, chat_template=template)
    assert query == prompts.query("what is R") and page == prompts.doc_template
