"""Padding-free sequences (``Retriever.set_packing``): packed rows give the padded path's
embeddings, losses and gradients, for the three families, with images, videos (Qwen2.5-VL's
``second_per_grid_ts``, Qwen3-VL's per-frame runs) and text-only samples, float32.

Each case builds one tiny model and compares the padded forward with the packed one on the same
weights: late-interaction embeddings, the late-interaction loss of queries (text only) against
the documents, and every parameter's gradient of that loss. The packed positions are also
checked against the model's own ``get_rope_index`` on each sample alone.
"""

from __future__ import annotations

import pytest
import torch

from raggedvl.losses import LateInteractionLoss
from raggedvl.models import Retriever, RetrieverConfig
from raggedvl.models.packed_attention import PACKED_SDPA, sequence_lengths, text_attention
from raggedvl.models.packing import mrope_position_ids, pack_batch, unpack_hidden
from raggedvl.batch import RaggedBatch
from tests.batch.synth import SMALL_IDS, make_features
from tests.batch.tiny_models import tiny_model

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
TOL = 2e-5  # float32 rounding of another summation order; a leak between sequences moves embeddings by ~0.6, row-continuous positions by ~1e-2
DOCS = [
    {"images": [(1, 4, 4)], "text": 3},
    {"text": 6},  # text only
    {"videos": [(2, 4, 4)], "text": 2},
    {"images": [(1, 2, 4), (1, 4, 2)], "videos": [(2, 2, 2)], "text": 9},  # several items, the longest sample
    {"images": [(1, 2, 2)], "text": 1},
]
QUERIES = [{"text": n} for n in (4, 9, 2, 6, 3)]


def _left_pad(feats: dict) -> dict:
    """The same batch padded on the left (each row's real tokens moved to its end)."""
    mask = feats["attention_mask"].bool()
    out = dict(feats)
    order = torch.argsort(mask.to(torch.int8), dim=1, stable=True)  # padding first, real tokens in order
    for key in ("input_ids", "attention_mask", "mm_token_type_ids"):
        out[key] = torch.gather(feats[key], 1, order)
    return out


def _retriever(family: str, attn: str) -> Retriever:
    backbone = tiny_model(family)
    backbone.set_attn_implementation(attn)
    model = Retriever(backbone, RetrieverConfig(dim=16, expected_modalities=("image", "video")))
    return model.train()


def _run(model: Retriever, queries: dict, docs: dict, packing: bool):
    model.set_packing(packing)
    model.zero_grad(set_to_none=True)
    q, d = model(queries=queries, docs=docs)
    loss = LateInteractionLoss(temperature=0.05, gather_across_ranks=False)(q.embeddings, q.mask, d.embeddings, d.mask)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.set_packing(False)
    return q.embeddings.detach(), d.embeddings.detach(), loss.detach(), grads


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("padding_side", ["right", "left"])
@pytest.mark.parametrize("family", FAMILIES)
def test_packed_equals_padded(family, padding_side, attn):
    model = _retriever(family, attn)
    docs = make_features(DOCS, family, seed=1)
    queries = make_features(QUERIES, family, seed=2)
    if padding_side == "left":
        docs, queries = _left_pad(docs), _left_pad(queries)
    want = _run(model, queries, docs, packing=False)
    got = _run(model, queries, docs, packing=True)
    for name, a, b in (("query embeddings", got[0], want[0]), ("doc embeddings", got[1], want[1]),
                       ("loss", got[2], want[2])):
        assert _max_diff(a, b) < TOL, (name, _max_diff(a, b))
    assert got[3].keys() == want[3].keys()
    assert any(n.startswith("backbone.visual") for n in want[3])  # the vision tower is in the comparison
    worst = max(_max_diff(got[3][n], want[3][n]) / max(1.0, float(want[3][n].abs().max())) for n in want[3])
    assert worst < TOL, worst
    assert abs(float(got[2]) - float(want[2])) < TOL and float(want[2]) > 0.1  # a real loss, not a degenerate 0


@pytest.mark.parametrize("family", FAMILIES)
def test_bi_encoder_and_text_only_batches(family):
    backbone = tiny_model(family)
    backbone.set_attn_implementation("sdpa")
    for pooling in ("last", "mean"):
        model = Retriever(backbone, RetrieverConfig(head="bi_encoder", pooling=pooling, dim=16)).eval()
        for batch in (make_features(DOCS, family, seed=3), make_features(QUERIES, family, seed=4)):
            with torch.no_grad():
                model.set_packing(False)
                want = model(**batch).embeddings
                model.set_packing(True)
                got = model(**batch).embeddings
            assert want.shape == got.shape == (len(batch["input_ids"]), 16)
            assert _max_diff(got, want) < TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_positions_are_each_sample_alone(family):
    model = tiny_model(family)
    docs = make_features(DOCS, family, seed=5)
    packed = pack_batch(model, docs)
    B, L = docs["input_ids"].shape
    lengths = docs["attention_mask"].sum(1).tolist()
    assert packed.num_tokens == sum(lengths) and packed.batch_shape == (B, L)
    assert packed.padding_fraction == pytest.approx(1 - sum(lengths) / (B * L))
    assert packed.cu_seqlens.tolist() == [sum(lengths[:i]) for i in range(B + 1)]
    assert "attention_mask" not in packed.inputs and packed.inputs["input_ids"].shape == (1, sum(lengths))
    pos = packed.inputs["position_ids"]
    assert pos.shape == (4, 1, sum(lengths))
    assert sequence_lengths(pos[0]) == [lengths]  # the text row marks each sample as its own sequence
    ragged = RaggedBatch.from_features(docs, family, token_ids=SMALL_IDS)
    start = 0
    for b in range(B):  # each sample alone (its own images, videos, second_per_grid_ts), the model's get_rope_index
        alone = ragged.select([b]).to_dict()
        real = alone["attention_mask"][0].bool()
        want = mrope_position_ids(model, alone)[:, 0, real]
        assert torch.equal(pos[1:, 0, start:start + lengths[b]], want), b
        assert torch.equal(pos[0, 0, start:start + lengths[b]], torch.arange(lengths[b]))
        start += lengths[b]


def test_second_per_grid_ts_moves_the_packed_video_positions():
    model = tiny_model("qwen2_5_vl")
    docs = make_features([{"videos": [(2, 4, 4)], "text": 2}], "qwen2_5_vl", seed=6)
    slow = dict(docs, second_per_grid_ts=torch.tensor([4.0], dtype=torch.float64))
    fast = dict(docs, second_per_grid_ts=torch.tensor([0.5], dtype=torch.float64))
    t_slow = pack_batch(model, slow).inputs["position_ids"][1]
    t_fast = pack_batch(model, fast).inputs["position_ids"][1]
    assert int(t_slow.max()) > int(t_fast.max())  # temporal positions follow the seconds per grid step


def test_unpack_scatters_back_and_checks_the_shape():
    model = tiny_model("qwen2_vl")
    docs = make_features(QUERIES, "qwen2_vl", seed=7)
    packed = pack_batch(model, docs)
    hidden = torch.randn(1, packed.num_tokens, 8, requires_grad=True)
    out = unpack_hidden(hidden, packed)
    mask = docs["attention_mask"].bool()
    assert out.shape == (*mask.shape, 8)
    assert torch.equal(out[mask], hidden[0]) and torch.count_nonzero(out[~mask]) == 0
    out.sum().backward()
    assert torch.equal(hidden.grad, torch.ones_like(hidden))
    with pytest.raises(ValueError, match=rf"\[1, {packed.num_tokens}, H\], got \[1, {packed.num_tokens - 1}, 8\]"):
        unpack_hidden(hidden[:, 1:], packed)


def test_grids_without_token_types_are_refused():
    model = tiny_model("qwen2_vl")
    docs = make_features(DOCS[:1], "qwen2_vl")
    docs.pop("mm_token_type_ids")
    with pytest.raises(ValueError, match="mm_token_type_ids"):
        pack_batch(model, docs)


def test_set_packing_switches_only_sdpa():
    for attn, packed in (("sdpa", PACKED_SDPA), ("eager", "eager")):
        backbone = tiny_model("qwen2_vl")
        backbone.set_attn_implementation(attn)
        model = Retriever(backbone, RetrieverConfig(dim=16))
        model.set_packing(True)
        assert text_attention(model.base_model) == packed
        assert model.base_model.config.vision_config._attn_implementation == attn  # the tower keeps its own
        model.set_packing(False)
        assert text_attention(model.base_model) == attn


def test_packing_with_lora_and_gradient_checkpointing():
    from raggedvl.models import LoraSettings

    backbone = tiny_model("qwen2_vl")
    backbone.set_attn_implementation("sdpa")
    model = Retriever(backbone, RetrieverConfig(dim=16, lora=LoraSettings(r=4, alpha=8, dropout=0.0))).train()
    model.set_gradient_checkpointing(True)
    docs, queries = make_features(DOCS, "qwen2_vl", seed=8), make_features(QUERIES, "qwen2_vl", seed=9)
    want = _run(model, queries, docs, packing=False)
    got = _run(model, queries, docs, packing=True)
    assert any("lora_" in n for n in want[3]) and got[3].keys() == want[3].keys()
    assert _max_diff(got[1], want[1]) < TOL and _max_diff(got[2], want[2]) < TOL
    assert max(_max_diff(got[3][n], want[3][n]) for n in want[3]) < TOL
