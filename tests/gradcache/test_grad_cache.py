"""GradCache in one process: chunking by a patch + token budget, and gradients equal to the
non-cached step (float64 tiny Qwen2-VL retriever), with dropout (C07), gradient checkpointing,
LoRA, both heads. The helpers at the top are shared with tests/dist/test_grad_cache_dist.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from raggedvl.batch import RaggedBatch, TokenIds
from raggedvl.losses import make_retrieval_loss
from raggedvl.models import EmbeddingOutput, LoraSettings, TinySizes, build_retriever
from raggedvl.gradcache import chunk_sizes, grad_cache_step, plan_chunks
from tests.models.helpers import make_batch, tiny_tokenizer

SIZES = TinySizes(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64,
                  vision_depth=1, vision_embed_dim=32, vision_heads=2)
TEXTS = ["an introduction to R", "biplot of multivariate data", "R data import and export", "the lazy dog",
         "writing R extensions", "sample quantiles of a vector", "fox", "quick brown fox jumps"]
GRIDS = [[(1, 4, 4)], [(1, 4, 8)], [(1, 8, 8)], [(1, 2, 4), (1, 4, 4)], [(1, 6, 4)], [(1, 4, 6)], [(1, 2, 2)], [(1, 8, 4)]]


def token_ids() -> TokenIds:
    tok = tiny_tokenizer()
    ids = tok.convert_tokens_to_ids
    return TokenIds(vision_start=ids("<|vision_start|>"), image=ids("<|image_pad|>"), video=ids("<|video_pad|>"))


def pair_batches(rows: list[int], *, padding_side: str = "right", seed: int = 0) -> tuple[RaggedBatch, RaggedBatch]:
    """Text-only queries and image documents for samples ``rows`` of TEXTS / GRIDS (float64 pixels;
    a document's pixels depend only on its own row)."""
    queries = make_batch([TEXTS[r] for r in rows], [[] for _ in rows], padding_side=padding_side)
    doc_texts = [TEXTS[(r + 3) % len(TEXTS)] for r in rows]
    docs = make_batch(doc_texts, [GRIDS[r] for r in rows], dtype=torch.float64, padding_side=padding_side)
    gen = torch.Generator().manual_seed(seed)
    table = {r: torch.randn(sum(t * h * w for t, h, w in GRIDS[r]), 1176, generator=gen, dtype=torch.float64)
             for r in range(len(GRIDS))}
    docs["pixel_values"] = torch.cat([table[r] for r in rows])
    tids = token_ids()
    return RaggedBatch.from_features(queries, token_ids=tids), RaggedBatch.from_features(docs, token_ids=tids)


def tiny_model(head: str = "late_interaction", *, lora_dropout: float | None = None, attention_dropout: float = 0.0,
               checkpointing: bool = False, seed: int = 0):
    """A float64 tiny retriever in train mode. With LoRA, the B matrices are made non-zero so
    that every adapter weight gets a gradient (peft initialises B at zero)."""
    lora = LoraSettings(r=4, alpha=8, dropout=lora_dropout) if lora_dropout is not None else None
    model = build_retriever("tiny", processor=tiny_tokenizer(), head=head, dim=16, tiny_sizes=SIZES, lora=lora,
                            gradient_checkpointing=checkpointing, seed=seed).double()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    for module in model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = attention_dropout
    return model.train()


def make_loss_fn(head: str, **kwargs):
    return make_retrieval_loss("infonce" if head == "bi_encoder" else "late_interaction", temperature=0.05, **kwargs)


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def plain_step(model, queries, docs, loss_fn) -> tuple[float, dict[str, torch.Tensor]]:
    """The non-cached step: one forward of each whole batch, one backward."""
    model.zero_grad(set_to_none=True)
    q, d = model(queries=queries, docs=docs)
    loss = loss_fn(q, d)
    loss.backward()
    return float(loss.detach()), grads(model)


def cached_step(model, queries, docs, loss_fn, budget: int):
    model.zero_grad(set_to_none=True)
    step = grad_cache_step(model, queries, docs, loss_fn, budget=budget)
    return step, grads(model)


def chunked_graph_step(model, queries, docs, loss_fn, budget: int) -> tuple[float, dict[str, torch.Tensor]]:
    """Reference for dropout: the same chunks encoded WITH graphs in pass-1 order (so each chunk
    draws its dropout masks from the same RNG position), assembled, one loss, ONE backward."""
    model.zero_grad(set_to_none=True)
    outs = []
    for batch in (queries, docs):
        embs, masks = [], []
        length = batch["input_ids"].shape[-1]
        for chunk in plan_chunks(batch, budget):
            out = model(**chunk.inputs)
            if out.mask is None:
                embs.append(out.embeddings)
                continue
            pad = (chunk.cols.start, length - chunk.cols.stop)
            embs.append(F.pad(out.embeddings, (0, 0, *pad)))
            masks.append(F.pad(out.mask, pad, value=False))
        outs.append(EmbeddingOutput(torch.cat(embs), torch.cat(masks) if masks else None))
    loss = loss_fn(*outs)
    loss.backward()
    return float(loss.detach()), grads(model)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


# ---------------------------------------------------------------- chunking


def test_chunk_sizes_greedy_budget_and_oversized_samples():
    assert chunk_sizes([3, 3, 3, 3], 6) == [2, 2]
    assert chunk_sizes([3, 3, 3, 3], 7) == [2, 2]
    assert chunk_sizes([5, 20, 1, 1, 4], 6) == [1, 1, 3]  # the 20 exceeds the budget: its own chunk
    assert chunk_sizes([4, 4, 4], 1) == [1, 1, 1]
    assert chunk_sizes([], 10) == []
    sizes = torch.randint(0, 50, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    counts = chunk_sizes(sizes, 60)
    assert sum(counts) == len(sizes) and min(counts) >= 1
    start = 0
    for n in counts:
        part = sizes[start:start + n]
        assert sum(part) <= 60 or n == 1
        start += n
    for bad in (0, -5, 2.5, True):
        with pytest.raises(ValueError, match="budget"):
            chunk_sizes([1, 2], bad)


def test_sample_sizes_count_patches_and_tokens():
    queries, docs = pair_batches([0, 3, 6])
    expect = [int(docs["attention_mask"][i].sum()) + sum(t * h * w for t, h, w in GRIDS[r]) for i, r in enumerate([0, 3, 6])]
    assert docs.sample_sizes().tolist() == expect
    assert queries.sample_sizes().tolist() == queries["attention_mask"].sum(1).tolist()


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_plan_chunks_cover_rows_and_trim_padding_columns(padding_side):
    _, docs = pair_batches([0, 1, 2, 3, 4, 5, 6, 7], padding_side=padding_side)
    sizes = docs.sample_sizes()
    chunks = plan_chunks(docs, 120)
    assert [c.rows.start for c in chunks] == [0, *[c.rows.stop for c in chunks[:-1]]]
    assert chunks[-1].rows.stop == docs.num_samples and len(chunks) > 2
    mask = docs["attention_mask"]
    for c in chunks:
        assert c.size == int(sizes[c.rows].sum()) and (c.size <= 120 or c.rows.stop - c.rows.start == 1)
        kept = c.inputs["attention_mask"]
        assert int(kept.sum()) == int(mask[c.rows].sum())  # no real token dropped
        assert bool(kept[:, -1].any())  # no trailing all-padding column kept
        if padding_side == "left":
            assert kept.shape[1] == mask.shape[1]  # leading padding stays (positions unchanged)
        n_img = sum(docs.image_counts[c.rows])
        assert c.inputs["image_grid_thw"].shape[0] == n_img
        assert c.inputs["pixel_values"].shape[0] == int(c.inputs["image_grid_thw"].prod(-1).sum())
    if padding_side == "right":  # trailing padding columns of short chunks are dropped
        assert any(c.cols.stop < mask.shape[1] for c in chunks)


def test_rejects_bad_inputs_before_encoding():
    model = tiny_model()
    queries, docs = pair_batches([0, 1])
    loss_fn = make_loss_fn("late_interaction")
    with pytest.raises(ValueError, match="budget"):
        grad_cache_step(model, queries, docs, loss_fn, budget=0)
    with pytest.raises(TypeError, match="RaggedBatch"):
        grad_cache_step(model, queries.to_dict(), docs, loss_fn, budget=64)
    with pytest.raises(ValueError, match="0 samples"):
        grad_cache_step(model, queries.split([0, 2])[0], docs, loss_fn, budget=64)
    assert all(p.grad is None for p in model.parameters())


# ---------------------------------------------------------------- exactness (W = 1)


@pytest.mark.parametrize(
    "head, lora, checkpointing, padding_side, budget",
    [
        ("late_interaction", False, False, "right", 30),
        ("late_interaction", True, True, "left", 1),
        ("bi_encoder", False, True, "right", 45),
        ("bi_encoder", True, False, "left", 40),
    ],
)
def test_gradients_equal_the_non_cached_step(head, lora, checkpointing, padding_side, budget):
    model = tiny_model(head, lora_dropout=0.0 if lora else None, checkpointing=checkpointing)
    queries, docs = pair_batches([0, 1, 2, 3, 4, 5], padding_side=padding_side)
    loss_fn = make_loss_fn(head)
    ref_loss, ref = plain_step(model, queries, docs, loss_fn)
    step, got = cached_step(model, queries, docs, loss_fn, budget)
    assert step.query_chunks > 1 and step.doc_chunks > 1
    assert (step.query_forwards, step.doc_forwards) == (step.query_chunks, step.doc_chunks)
    assert abs(float(step.loss) - ref_loss) < 1e-10
    assert max_diff(got, ref) < 1e-10
    assert max(float(g.abs().max()) for g in ref.values()) > 1e-4  # gradients are not trivially zero


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")])


def _rng_state(device: str) -> torch.Tensor:
    return torch.cuda.get_rng_state() if device == "cuda" else torch.get_rng_state()


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("head", ["late_interaction", "bi_encoder"])
def test_c07_dropout_masks_are_replayed(head, device):
    """C07: dropout 0.1 (LoRA and attention), batch 4, chunk 1: the cached gradients equal the
    gradients of one backward through the same chunks with graphs, and the RNG stream after the
    step is where that forward left it."""
    model = tiny_model(head, lora_dropout=0.1, attention_dropout=0.1).to(device)
    queries, docs = (b.to(device) for b in pair_batches([0, 1, 2, 3]))
    loss_fn = make_loss_fn(head)
    torch.manual_seed(123)
    ref_loss, ref = chunked_graph_step(model, queries, docs, loss_fn, budget=1)
    rng_after_ref = _rng_state(device)
    torch.manual_seed(123)
    step, got = cached_step(model, queries, docs, loss_fn, budget=1)
    assert (step.query_chunks, step.doc_chunks) == (4, 4)
    assert abs(float(step.loss) - ref_loss) < 1e-10
    assert max_diff(got, ref) < 1e-10
    assert torch.equal(_rng_state(device), rng_after_ref)
    # The masks matter: other draws give clearly different gradients, so equality above needs the replay.
    torch.manual_seed(124)
    _, other = chunked_graph_step(model, queries, docs, loss_fn, budget=1)
    assert max_diff(other, ref) > 1e-4
