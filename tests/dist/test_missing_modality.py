"""Ranks lacking a modality, on every path, on 2 gloo processes.

Rank 0 and rank 1 get different modality mixes (images vs text only, images + video vs images
only, video vs text only), for Qwen2-VL, Qwen2.5-VL and Qwen3-VL (deepstack), with and without
activation checkpointing, full fine-tuning and LoRA, DDP and FSDP2. Before the fix these runs
hung or aborted:

- SFT through ``RaggedSFTTrainer`` with activation checkpointing (DDP then runs with
  ``find_unused_parameters=False``), full fine-tuning: rank 0 (images) blocked forever in the
  first backward, waiting for vision-tower gradients rank 1 (text only) never produced;
- FSDP2 (``wrap_model(strategy="fsdp2")``): the ranks all-gathered the vision blocks' and the
  decoder layers' parameters in different orders (the retriever ran its dummy vision pass after
  the decoder), so gloo aborted with a size mismatch; an SFT generator ran no tower at all on
  a text-only rank.

One launch runs every case (spawning costs more than the cases). Each case checks that both
ranks made the same vision-tower and decoder calls in the same order, and that every trainable
parameter's gradient (float64; DDP's average, FSDP2's reduce-scattered shards gathered whole)
equals the single-process gradient on the concatenated global batch, computed here in the
parent process without a process group. The ``RaggedTrainer`` case compares the weights after
two SGD steps with two single-process steps instead.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

from tests.dist.harness import run_distributed

pytestmark = pytest.mark.dist

TOL = 1e-10
LR = 0.5
TEMPERATURE = 0.05

IMG = {"images": [(1, 4, 4)], "text": 3}
IMG2 = {"images": [(1, 2, 4), (1, 4, 2)], "text": 2}
VID = {"videos": [(2, 4, 4)], "text": 2}
TXT = {"text": 5}
TXT2 = {"text": 3}
TXT13 = {"text": 12}  # 13 tokens, as many as IMG2 (GradCache keeps every chunk at the batch's width)


@dataclass(frozen=True)
class Case:
    task: str  # "retrieval" (Retriever + late-interaction loss) or "sft" (*ForConditionalGeneration)
    family: str
    strategy: str  # "ddp" | "fsdp2"
    checkpointing: bool
    lora: bool
    expected: tuple[str, ...]
    rank0: tuple[dict, ...]  # documents (retrieval) or samples (sft) of rank 0
    rank1: tuple[dict, ...]
    grad_cache_budget: int | None = None  # retrieval: the step through GradCache, chunks of this many patches + tokens


CASES = {
    # the retriever under DDP (find_unused_parameters=False), plain and checkpointed (case C04)
    "retrieval-qwen2_vl-ddp-text_only_rank": Case("retrieval", "qwen2_vl", "ddp", False, False, ("image",),
                                                  (IMG, IMG2), (TXT,)),
    "retrieval-qwen3_vl-ddp-ckpt-video_vs_text_only": Case("retrieval", "qwen3_vl", "ddp", True, False,
                                                           ("image", "video"), (VID,), (TXT, TXT2)),
    # the retriever under FSDP2: the reported abort, and image+video vs images (deepstack, checkpointed)
    "retrieval-qwen2_vl-fsdp2-text_only_rank": Case("retrieval", "qwen2_vl", "fsdp2", False, False, ("image",),
                                                    (IMG, IMG2), (TXT,)),
    "retrieval-qwen2_5_vl-fsdp2-image_video_vs_images": Case("retrieval", "qwen2_5_vl", "fsdp2", False, False,
                                                             ("image", "video"), (IMG, VID), (IMG2,)),
    "retrieval-qwen3_vl-fsdp2-ckpt-image_video_vs_images": Case("retrieval", "qwen3_vl", "fsdp2", True, False,
                                                                ("image", "video"), (VID, IMG), (IMG2, TXT)),
    # GradCache under FSDP2: rank 0 cuts 2 document chunks (images), rank 1 one (text only) + a padding chunk
    "retrieval-qwen2_vl-fsdp2-gradcache-text_only_rank": Case("retrieval", "qwen2_vl", "fsdp2", False, False,
                                                              ("image",), (IMG2, IMG2), (TXT13,), grad_cache_budget=30),
    # the SFT generator: DDP without find_unused_parameters, and FSDP2; full fine-tuning and LoRA
    "sft-qwen2_vl-ddp-ckpt-text_only_rank": Case("sft", "qwen2_vl", "ddp", True, False, ("image",),
                                                 (IMG, IMG2), (TXT, TXT2)),
    "sft-qwen2_vl-ddp-lora-ckpt-text_only_rank": Case("sft", "qwen2_vl", "ddp", True, True, ("image",),
                                                      (IMG2,), (TXT,)),
    "sft-qwen2_vl-fsdp2-text_only_rank": Case("sft", "qwen2_vl", "fsdp2", False, False, ("image",),
                                              (TXT,), (IMG, IMG2)),
    "sft-qwen2_5_vl-fsdp2-ckpt-image_video_vs_images": Case("sft", "qwen2_5_vl", "fsdp2", True, False,
                                                            ("image", "video"), (IMG, VID), (IMG2,)),
    "sft-qwen3_vl-ddp-ckpt-video_vs_text_only": Case("sft", "qwen3_vl", "ddp", True, False, ("image", "video"),
                                                     (VID, IMG), (TXT,)),
    "sft-qwen3_vl-fsdp2-lora-video_vs_text_only": Case("sft", "qwen3_vl", "fsdp2", False, True,
                                                       ("image", "video"), (TXT2,), (VID,)),
}


# ------------------------------------------------------------------ shared by the ranks and the reference
def _global_batches(case: Case):
    """The global batch as (queries, docs) RaggedBatches (retrieval) or (None, samples) (sft),
    and the number of rank 0's samples; rank r's share is a split of it."""
    from raggedvl.batch import RaggedBatch
    from tests.batch.synth import SMALL_IDS, make_features

    samples = list(case.rank0 + case.rank1)
    labels = case.task == "sft"
    docs = RaggedBatch.from_features(make_features(samples, layout=case.family, seed=1, labels=labels),
                                     case.family, token_ids=SMALL_IDS)
    queries = None
    if case.task == "retrieval":
        # GradCache drops a chunk's all-padding columns, and a shorter text-only sequence gets float32
        # rotary tables that differ in the last bit (~1e-8 in the gradient): equal query lengths there
        texts = [{"text": 3 if case.grad_cache_budget else 2 + i % 3} for i in range(len(samples))]
        queries = RaggedBatch.from_features(make_features(texts, layout=case.family, seed=2), case.family,
                                            token_ids=SMALL_IDS)
    return queries, docs, len(case.rank0)


def _build(case: Case):
    """The case's model, float64, training mode, identical on every rank (seeded)."""
    from raggedvl.models import LoraSettings, Retriever, RetrieverConfig, install_dummy_vision
    from raggedvl.hf import apply_generation_lora
    from tests.batch.tiny_models import tiny_generator, tiny_model

    lora = LoraSettings(r=4, alpha=8, dropout=0.0) if case.lora else None
    if case.task == "retrieval":
        model = Retriever(tiny_model(case.family), RetrieverConfig(dim=16, expected_modalities=case.expected, lora=lora))
        model.set_gradient_checkpointing(case.checkpointing)
    else:
        model = tiny_generator(case.family)
        if case.checkpointing:
            model.activation_checkpointing_enable({"use_reentrant": False})
        if lora is not None:
            model = apply_generation_lora(model, lora)
        install_dummy_vision(model, case.expected)
    torch.manual_seed(1)
    return model.double().train()


def _loss(case: Case, model, queries, docs, n_items: int | None, world_size: int, gather: bool):
    from raggedvl.losses import make_retrieval_loss

    if case.task == "retrieval":
        loss_fn = make_retrieval_loss("late_interaction", temperature=TEMPERATURE, gather_across_ranks=gather)
        return loss_fn(*model(queries=queries, docs=docs))
    # token sum over the global label count, times W: DDP / FSDP2 average the gradients over W
    out = model(**docs.to_dict(), use_cache=False, num_items_in_batch=n_items)
    return out.loss * world_size


def _label_tokens(docs) -> int:
    return int(docs["labels"][:, 1:].ne(-100).sum())


def _record_calls(model):
    from raggedvl.models import vision_base_model

    base = vision_base_model(model)
    calls: list[str] = []
    base.visual.register_forward_pre_hook(lambda *_: calls.append("vision tower"))
    base.language_model.register_forward_pre_hook(lambda *_: calls.append("decoder"))
    return calls


# ------------------------------------------------------------------ the ranks
def _run_case(case: Case, rank: int, world_size: int) -> dict:
    from raggedvl.parallel.wrap import unwrap_model, wrap_model

    queries, docs, n0 = _global_batches(case)
    n_items = _label_tokens(docs) if case.task == "sft" else None
    sizes = [n0, docs.num_samples - n0]
    mine_d = docs.split(sizes)[rank]
    mine_q = queries.split(sizes)[rank] if queries is not None else None
    model = _build(case)
    calls = _record_calls(model)
    wrapped = wrap_model(model, strategy=case.strategy)
    if case.grad_cache_budget is None:
        loss = _loss(case, wrapped, mine_q, mine_d, n_items, world_size, gather=True)
        forward_calls = list(calls)
        loss.backward()
    else:  # the recorded calls include the replays' forwards
        from raggedvl.gradcache import grad_cache_step
        from raggedvl.losses import make_retrieval_loss

        step = grad_cache_step(wrapped, mine_q, mine_d, make_retrieval_loss("late_interaction", temperature=TEMPERATURE),
                               budget=case.grad_cache_budget)
        forward_calls = list(calls)
        forward_calls.append(f"doc chunks {step.doc_chunks}, forwards {step.doc_forwards}")
    grads = {}
    for name, p in unwrap_model(wrapped).named_parameters():
        if not p.requires_grad:
            continue
        g = p.grad
        if g is not None and hasattr(g, "full_tensor"):  # FSDP2: a sharded DTensor (collective)
            g = g.full_tensor()
        grads[name] = None if g is None else g.detach().clone()
    return {"calls": forward_calls, "grads": grads, "wrapped": type(wrapped).__name__}


def _sft_stream():
    """Two steps of 2 samples per rank: rank 0 gets the image samples, rank 1 the text-only ones."""
    from tests.hf.helpers import page, sft_examples

    two, text, three = sft_examples()
    other = {"images": [], "prompt": "name a plot", "answer": "a biplot of multivariate data"}
    one = {"images": [page(56, 84, 9)], "prompt": "what is shown", "answer": "a scatter plot"}
    return [two, three, text, other, one, two, other, text]


def _run_trainer(rank: int, out_dir: str) -> dict:
    """The reported hang: RaggedSFTTrainer, full fine-tuning, activation checkpointing, DDP."""
    from torch.utils.data import IterableDataset

    from raggedvl.hf import RaggedSFTTrainer, SFTCollator
    from tests.hf.helpers import tiny_generator, tiny_processor, training_args

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(_sft_stream())

    proc = tiny_processor()
    model = tiny_generator()
    args = training_args(f"{out_dir}/trainer{rank}", learning_rate=LR, max_steps=2, activation_checkpointing=True,
                         activation_checkpointing_kwargs={"use_reentrant": False})
    trainer = RaggedSFTTrainer(model, args, processor=proc, train_dataset=Stream(),
                            data_collator=SFTCollator(proc))
    trainer.train()
    ddp = trainer.model_wrapped
    return {
        "find_unused_parameters": getattr(ddp, "find_unused_parameters", None),
        "checkpointing": model.is_activation_checkpointing,
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


def _worker(rank: int, world_size: int, out_dir: str, names: list[str]) -> str:
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
    out = {name: _run_case(CASES[name], rank, world_size) for name in names if name in CASES}
    if "trainer" in names:
        out["trainer"] = _run_trainer(rank, out_dir)
    path = f"{out_dir}/rank{rank}.pt"
    torch.save(out, path)
    return path


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("modality")
    paths = run_distributed(_worker, 2, str(out), [*CASES, "trainer"], timeout=300)
    return [torch.load(p, weights_only=False) for p in paths]


# ------------------------------------------------------------------ the single-process references
def _reference_grads(case: Case) -> dict[str, torch.Tensor]:
    queries, docs, _ = _global_batches(case)
    model = _build(case)
    loss = _loss(case, model, queries, docs, None, 1, gather=False)  # sft: the model's token mean
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("name", list(CASES))
def test_every_rank_makes_the_same_tower_calls_before_the_decoder(results, name):
    case = CASES[name]
    r0, r1 = results[0][name], results[1][name]
    per_encode = ["vision tower"] * len(case.expected) + ["decoder"]
    encodes = 2 if case.task == "retrieval" else 1  # queries, then documents, in one forward
    if case.grad_cache_budget is None:
        assert r0["calls"] == r1["calls"] == per_encode * encodes, (r0["calls"], r1["calls"])
    else:  # 1 query chunk and 2 document chunks (rank 1: 1 + a padding chunk), each encoded twice
        assert r0["calls"][-1] == "doc chunks 2, forwards 2" and r1["calls"][-1] == "doc chunks 1, forwards 2"
        assert r0["calls"][:-1] == r1["calls"][:-1] == per_encode * 6
    wrapper = "DistributedDataParallel" if case.strategy == "ddp" else "FSDP"
    assert r0["wrapped"].startswith(wrapper)


@pytest.mark.parametrize("name", list(CASES))
def test_gradients_equal_the_single_process_reference(results, name):
    ref = _reference_grads(CASES[name])
    assert any("visual" in n for n in ref) != CASES[name].lora  # full fine-tuning trains the tower
    worst = 0.0
    for r in results:
        got = r[name]["grads"]
        assert set(got) == set(ref)
        for n, want in ref.items():
            assert want is not None and got[n] is not None, n
            torch.testing.assert_close(got[n], want, rtol=0, atol=TOL, msg=f"{name}: {n}")
            worst = max(worst, float((got[n] - want).abs().max()))
    assert any(float(g.abs().max()) > 0 for n, g in ref.items() if "visual" in n or "lora_B" in n)
    print(f"{name}: max |grad - single process| = {worst:.2e}")


def test_sft_trainer_with_a_text_only_rank_finishes_and_matches_one_process(results):
    """Two steps; each gives rank 0 image samples and rank 1 text-only samples (dispatch)."""
    from raggedvl.batch import TokenIds
    from raggedvl.hf import SFTCollator, unpack
    from tests.hf.helpers import tiny_generator, tiny_processor

    proc = tiny_processor()
    stream = _sft_stream()
    model = tiny_generator()
    for step in range(2):
        batch = unpack(SFTCollator(proc)(stream[4 * step:4 * step + 4]), token_ids=TokenIds.from_any(proc),
                       pad_token_id=proc.tokenizer.pad_token_id)
        assert batch.image_counts[2:] == [0, 0] and all(batch.image_counts[:2])  # rank 1's share is text only
        model.zero_grad(set_to_none=True)
        model(**batch.to_dict(), use_cache=False).loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
    worst = 0.0
    for r in results:
        got = r["trainer"]
        assert got["find_unused_parameters"] is False and got["checkpointing"]  # the configuration that hung
        assert len(got["losses"]) == 2
        for n, p in model.named_parameters():
            torch.testing.assert_close(got["params"][n], p.detach(), rtol=0, atol=TOL, msg=n)
            worst = max(worst, float((got["params"][n] - p.detach()).abs().max()))
    print(f"RaggedTrainer sft: max |weight - single process| after 2 steps = {worst:.2e}")
