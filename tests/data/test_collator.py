"""RetrievalCollator: ragged output, templates, truncation that never cuts placeholders (C09), bad examples."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from PIL import Image

from raggedvl.batch import RaggedBatch
from raggedvl.data import DOC_TEMPLATE, BadImageError, RetrievalCollator
from raggedvl.prompts import RetrievalPrompts


def _examples():
    sizes = [(448, 448), (224, 224), (28, 28), (31, 639), (1200, 300)]
    return [
        {"query": f"find the page about topic {i}", "image": Image.new("RGB", size, (20 * i, 100, 200)), "id": f"doc{i}"}
        for i, size in enumerate(sizes)
    ]


def test_ragged_output_matches_the_processor(tiny_processor):
    collate = RetrievalCollator(tiny_processor)
    examples = _examples()
    batch = collate(examples)
    assert batch["ids"] == [e["id"] for e in examples] and batch["skipped"] == []
    queries, docs = batch["queries"], batch["docs"]
    assert isinstance(queries, RaggedBatch) and isinstance(docs, RaggedBatch)
    assert queries.num_samples == docs.num_samples == 5
    assert queries.image_counts == [0] * 5 and "pixel_values" not in queries.keys()
    assert docs.image_counts == [1] * 5
    grids = docs["image_grid_thw"]
    assert grids[0].tolist() == [1, 32, 32] and grids[1].tolist() == [1, 16, 16] and grids[2].tolist() == [1, 4, 4]
    assert docs["pixel_values"].shape[0] == int(grids.prod(dim=1).sum())  # flat, no per-image padding
    reference = tiny_processor(text=[DOC_TEMPLATE], images=[examples[1]["image"]], return_tensors="pt")
    alone = docs.select([1])
    assert torch.equal(alone["pixel_values"], reference["pixel_values"])
    length = int(reference["attention_mask"].sum())
    assert torch.equal(alone["input_ids"][0, :length], reference["input_ids"][0])
    decoded = tiny_processor.tokenizer.decode(queries["input_ids"][2][queries["attention_mask"][2].bool()])
    assert decoded.startswith("find the page about topic 2") and decoded.count("<|endoftext|>") == 10  # colpali prompt
    for i in range(5):  # each sample's placeholders match its own grid
        n_tokens = int((docs["input_ids"][i] == tiny_processor.image_token_id).sum())
        assert n_tokens == int(grids[i].prod()) // 4


def test_pre_resize_uses_the_torchvision_kernel_and_leaves_the_processor_nothing_to_resize(tiny_processor):
    """The collator resizes with transformers' default (torchvision) kernel (the colpali fixture
    tests show the resulting document embeddings equal colpali-engine's); the processor then
    keeps that size, so its pixels are those of the pre-resized image."""
    from raggedvl.images import resize_image

    noise = np.random.default_rng(0).integers(0, 256, (900, 700, 3), dtype=np.uint8)
    image = Image.fromarray(noise)  # smart_resize target: 392 x 504 (a 1.8x downscale)
    ours = RetrievalCollator(tiny_processor)([{"query": "a page", "image": image, "id": "n"}])["docs"]
    bare = tiny_processor(text=[DOC_TEMPLATE], images=[resize_image(image, (392, 504))], return_tensors="pt")
    assert ours["image_grid_thw"].tolist() == bare["image_grid_thw"].tolist() == [[1, 36, 28]]
    assert torch.equal(ours["pixel_values"], bare["pixel_values"])
    pil = tiny_processor(text=[DOC_TEMPLATE], images=[image], return_tensors="pt")  # PIL's bicubic differs
    assert not torch.equal(ours["pixel_values"], pil["pixel_values"])


def test_truncation_never_cuts_image_placeholders(tiny_processor):
    """C09: a 448x448 image (256 placeholders) with max_length 200 is a clear error, before any forward."""
    collate = RetrievalCollator(tiny_processor, max_length=200)
    examples = _examples()[:2]
    with pytest.raises(ValueError, match=r"example 'doc0' has \d+ tokens \(256 image placeholder tokens.*max_length=200"):
        collate(examples)
    short = RetrievalCollator(tiny_processor, max_length=12)
    long_query = {"query": "word " * 100, "image": Image.new("RGB", (56, 56)), "id": "q"}
    with pytest.raises(ValueError, match="max_length=12"):
        short([long_query])  # the document (4 placeholders + template) does not fit 12 tokens
    roomy = RetrievalCollator(tiny_processor, max_length=30)
    batch = roomy([long_query])
    assert batch["queries"]["input_ids"].shape[1] == 30  # queries (text only) are truncated
    assert int((batch["docs"]["input_ids"] == tiny_processor.image_token_id).sum()) == 4


def test_bad_examples(tiny_processor):
    examples = _examples()
    examples[3] = {"query": "broken page scan", "image": b"not an image", "id": "bad"}
    with pytest.raises(BadImageError, match="'bad'"):
        RetrievalCollator(tiny_processor)(examples)
    lenient = RetrievalCollator(tiny_processor, on_bad_image="skip")
    batch = lenient(examples)
    assert batch["ids"] == ["doc0", "doc1", "doc2", "doc4"]
    assert [s["id"] for s in batch["skipped"]] == ["bad"] and "cannot be decoded" in batch["skipped"][0]["reason"]
    assert batch["docs"].num_samples == batch["queries"].num_samples == 4
    from_dataset_skip = {"query": "x y", "image": None, "image_error": "row 9: truncated", "id": "r9"}
    assert lenient([examples[0], from_dataset_skip])["skipped"] == [{"id": "r9", "reason": "row 9: truncated"}]
    with pytest.raises(ValueError, match="every example"):
        lenient([from_dataset_skip])
    with pytest.raises(ValueError, match=r"example 0 \(id 'e'\) has an empty"):
        lenient([{"query": "", "image": Image.new("RGB", (28, 28)), "id": "e"}])
    with pytest.raises(ValueError, match="reads as a visual placeholder"):
        lenient([{"query": "see <|image_pad|> here", "image": Image.new("RGB", (28, 28)), "id": "inj"}])
    with pytest.raises(ValueError, match=r"lacks \['image'\]"):
        lenient([{"query": "a b", "id": "m"}])


def test_layout_follows_the_processors_family_and_a_mismatched_geometry_raises(tiny_processor):
    assert RetrievalCollator(tiny_processor).layout == "qwen2_vl"  # a Qwen2VLProcessor subclass
    stated = copy.deepcopy(tiny_processor)
    stated.model_type = "qwen2_5_vl"  # what a checkpoint's config states wins over the class
    assert RetrievalCollator(stated).layout == "qwen2_5_vl"
    patch16 = copy.deepcopy(tiny_processor)
    patch16.image_processor.patch_size = 16  # no longer guessed to be Qwen3-VL: a mismatch is an error
    with pytest.raises(ValueError, match="patch_size 16, where qwen2_vl has 14"):
        RetrievalCollator(patch16)


def test_prompts_are_validated_and_configurable(tiny_processor):
    with pytest.raises(ValueError, match="query_template"):
        RetrievalPrompts(query_template="no placeholder")
    with pytest.raises(ValueError, match="doc_template"):
        RetrievalPrompts(doc_template="<|image_pad|> twice <|image_pad|>")
    with pytest.raises(ValueError, match="padding_side"):
        RetrievalPrompts(padding_side="middle")
    prompts = RetrievalPrompts(query_template="Q: {query}", doc_template="<|vision_start|><|image_pad|><|vision_end|>page",
                               padding_side="left")
    examples = _examples()[:2]
    examples[1]["query"] = "a much longer query about the pages of several other topics"
    batch = RetrievalCollator(tiny_processor, prompts=prompts)(examples)
    ids, mask = batch["queries"]["input_ids"], batch["queries"]["attention_mask"]
    assert not bool(mask.all())
    assert tiny_processor.tokenizer.decode(ids[0][mask[0].bool()]) == "Q: find the page about topic 0"
    for m in (mask, batch["docs"]["attention_mask"]):  # left padding: every row ends with a real token
        assert bool(m[:, -1].all())
