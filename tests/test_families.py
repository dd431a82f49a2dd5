"""The family registry (raggedvl.families): one entry is a whole family. A fake fourth family
(patch 8 instead of 14/16, images only) is added by one ``FAMILIES`` entry, and a batch goes
through collate, split / select / concat, scatter and the retriever's forward with nothing else
changed; the three Qwen-VL families resolve from configs, models and processors by model_type."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Qwen2VLConfig, Qwen2VLModel
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from raggedvl.batch import RaggedBatch
from raggedvl.data import RetrievalCollator
from raggedvl.data.processing import Qwen2VLImageTextProcessor
from raggedvl.families import FAMILIES, IMAGE, Family, family_of, get_layout
from raggedvl.models import Retriever, RetrieverConfig, tiny_backbone_config
from raggedvl.parallel import scatter_batch
from tests.hf.helpers import page, tiny_processor


class FakeVLConfig(Qwen2VLConfig):
    model_type = "fake_vl"


class FakeVLModel(Qwen2VLModel):
    config_class = FakeVLConfig


class FakeVLProcessor(Qwen2VLImageTextProcessor):
    pass


FAKE = Family("fake_vl", f"{__name__}:FakeVLConfig", f"{__name__}:FakeVLModel", "FakeVLProcessor",
              patch_size=8, streams=(IMAGE,))


@pytest.fixture
def fake_family(monkeypatch):
    monkeypatch.setitem(FAMILIES, "fake_vl", FAKE)
    return FAKE


def _fake_processor():
    image_processor = Qwen2VLImageProcessorPil(patch_size=8, merge_size=2, min_pixels=16 * 16, max_pixels=64 * 64)
    return FakeVLProcessor(image_processor=image_processor, tokenizer=tiny_processor().tokenizer)


def _fake_backbone():
    data = tiny_backbone_config(tiny_processor().tokenizer, "qwen2_vl").to_dict()
    data.pop("model_type", None)
    data["vision_config"]["patch_size"] = FAKE.patch_size
    torch.manual_seed(0)
    return FakeVLModel._from_config(FakeVLConfig(**data), attn_implementation="eager").to(torch.float64)


def test_the_registry_resolves_every_qwen_family_by_model_type():
    for name, family in FAMILIES.items():
        assert family.name == name and family.layout.name == name and get_layout(name) is family.layout
        assert family.config_class().model_type == name  # the entry's classes belong to its model_type
        assert family.model_class.config_class is family.config_class
        assert family_of(family.config_class()) is family and family_of(name) is family
        assert family.patch_dim == 3 * family.temporal_patch_size * family.patch_size ** 2
    assert [FAMILIES[n].patch_dim for n in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")] == [1176, 1176, 1536]
    assert family_of(tiny_processor()) is FAMILIES["qwen2_vl"]  # Qwen2VLProcessor subclass
    with pytest.raises(ValueError, match="model_type 'llama'"):
        family_of(type("Cfg", (), {"model_type": "llama"})())
    with pytest.raises(ValueError, match="fake_vl"):
        family_of("fake_vl")  # not registered outside the fixture


def test_a_fourth_family_is_one_registry_entry(fake_family):
    processor = _fake_processor()
    backbone = _fake_backbone()
    assert family_of(processor) is fake_family and family_of(backbone) is fake_family
    assert family_of(backbone.config) is fake_family

    # collate: layout, patch width and the resize factor (16 px) all come from the entry
    sizes = [(32, 32), (48, 16), (16, 64), (32, 48), (64, 64)]
    examples = [{"query": f"query {i}", "image": page(h, w, seed=i), "id": f"e{i}"} for i, (h, w) in enumerate(sizes)]
    batch = RetrievalCollator(processor)(examples)
    docs, queries = batch["docs"], batch["queries"]
    assert docs.layout_name == "fake_vl" and docs.layout is fake_family.layout
    assert docs["pixel_values"].shape[1] == fake_family.patch_dim == 384
    grids = docs["image_grid_thw"]
    assert grids.tolist() == [[1, h // 8, w // 8] for h, w in sizes]  # sizes are multiples of 16: kept
    assert "pixel_values_videos" not in fake_family.layout.known_keys

    # split / select / concat by whole samples
    parts = docs.split([2, 3])
    assert [p.num_samples for p in parts] == [2, 3]
    assert torch.equal(parts[1]["image_grid_thw"], grids[2:])
    picked = docs.select([4, 0])
    assert torch.equal(picked["pixel_values"][: int(picked.patch_counts()[0])],
                       docs["pixel_values"][int(docs.patch_offsets()[4]):])
    rejoined = RaggedBatch.concat(parts, pad_token_id=processor.tokenizer.pad_token_id)
    assert all(torch.equal(rejoined[k], docs[k]) for k in docs.keys())

    # scatter over 2 replicas: whole samples, every sample once
    scattered = scatter_batch(docs, 2)
    assert sorted(i for part in scattered.indices for i in part) == list(range(5))
    assert all(s.layout is fake_family.layout for s in scattered.shards)

    # forward: the retriever reads its inputs and dummy-pass streams from the entry; per-sample
    # embeddings of each shard equal those of the whole batch (no sample sees another's rows)
    model = Retriever(backbone, RetrieverConfig(dim=16)).to(torch.float64).eval()
    assert model.family is fake_family
    with torch.no_grad():
        whole = model(**docs.to(torch.float64))
        shard_out = [model(**s.to(torch.float64)) for s in scattered.shards]
        text_only = model(**queries)  # the dummy vision pass runs the fake tower's image stream
    for part, out in zip(scattered.indices, shard_out):
        for row, i in enumerate(part):
            n = int(out.mask[row].sum())
            assert n == int(whole.mask[i].sum())
            torch.testing.assert_close(out.embeddings[row, :n], whole.embeddings[i, :n])
    assert text_only.embeddings.shape[0] == len(examples) and torch.isfinite(text_only.embeddings).all()
    video = dict(docs.to_dict(), pixel_values_videos=docs["pixel_values"], video_grid_thw=grids)
    with pytest.raises(TypeError, match="fake_vl Retriever got inputs"):
        model(**video)


def test_a_processor_whose_geometry_disagrees_with_its_family_is_refused(fake_family):
    wrong = copy.deepcopy(_fake_processor())
    wrong.image_processor.patch_size = 14
    with pytest.raises(ValueError, match="patch_size 14, where fake_vl has 8"):
        RetrievalCollator(wrong)


def test_registry_entries_survive_deepcopy_and_pickle():
    """Models hold their family: ``copy.deepcopy(model)``, ``torch.save`` and spawn must work."""
    import pickle

    for family in FAMILIES.values():
        for copied in (copy.deepcopy(family), pickle.loads(pickle.dumps(family))):
            assert copied == family
            with pytest.raises(TypeError):  # still read-only after the round trip
                copied.layout.sample_dims["input_ids"] = 1
