"""Training dynamics of the tiny retriever: does it collapse, does it memorise the train pairs?

One process, global batch G, in-batch negatives, ColBERT MaxSim normalised by query length,
logits = score / temperature (issue 3's LateInteractionLoss formula), AdamW with linear warmup
and cosine decay. Prints per-phase training loss, the collapse metric (mean pairwise cosine of
the documents' mean-pooled embeddings) and train/dev nDCG@5 beside a random ranker's.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/tiny_recipe.py            # the tiny recipe
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/tiny_recipe.py --init-range 0.02 --lr 1e-3 --head-lr 1e-3

Defaults come from ``raggedvl.models.TINY_TRAINING_DEFAULTS``. Single-process G equals the 2-rank default job with G/2 per rank (the cross-rank loss is exact).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, get_cosine_schedule_with_warmup
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from PIL import Image

from raggedvl.data.rdocs import DEFAULT_JOB_DEV_PAIRS, DEFAULT_JOB_TRAIN_PAIRS, build_rdocs
from raggedvl.models import TINY_TRAINING_DEFAULTS as R
from raggedvl.models import TinySizes, build_retriever

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
           "<|image_pad|>", "<|video_pad|>"]
DOC_PROMPT = "Describe the image."


def make_tokenizer(texts: list[str], vocab: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|im_end|>")


def encode_items(records, root: Path, tok, imgproc):
    """Per item: (query ids, doc ids, doc pixel rows, doc grid)."""
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL}
    items = []
    for r in records:
        img = Image.open(root / r["image"]).convert("RGB")
        px = imgproc(images=[img], return_tensors="pt")
        grid = px["image_grid_thw"]
        n_tok = int(grid.prod()) // 4
        doc = [ids["<|vision_start|>"]] + [ids["<|image_pad|>"]] * n_tok + [ids["<|vision_end|>"]]
        doc += tok(DOC_PROMPT, add_special_tokens=False)["input_ids"]
        query = tok("Query: " + r["query"], add_special_tokens=False)["input_ids"]
        items.append((query, doc, px["pixel_values"], grid))
    return items


def collate(rows, tok, image_token_id):
    L = max(len(r) for r in rows)
    ids = torch.full((len(rows), L), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), L), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    batch = {"input_ids": ids, "attention_mask": mask, "mm_token_type_ids": (ids == image_token_id).int()}
    return batch


def encode(model, items, idx, tok, image_token_id):
    q = collate([items[i][0] for i in idx], tok, image_token_id)
    d = collate([items[i][1] for i in idx], tok, image_token_id)
    d["pixel_values"] = torch.cat([items[i][2] for i in idx])
    d["image_grid_thw"] = torch.cat([items[i][3] for i in idx])
    return model.encode_pair(q, d)


def maxsim(q, d):
    """[nq, Lq, D] x [nd, Ld, D] -> [nq, nd], masked, normalised by query length."""
    sim = torch.einsum("qld,nmd->qnlm", q.embeddings, d.embeddings)
    sim = sim.masked_fill(~d.mask[None, :, None, :], float("-inf")).amax(-1)
    sim = (sim * q.mask[:, None, :]).sum(-1)
    return sim / q.mask.sum(-1, keepdim=True)


def doc_cosine(d):
    pooled = (d.embeddings.sum(1) / d.mask.sum(1, keepdim=True)).float()
    pooled = F.normalize(pooled, dim=-1)
    cos = pooled @ pooled.T
    n = cos.shape[0]
    return float((cos.sum() - n) / (n * (n - 1)))


@torch.no_grad()
def evaluate(model, items, tok, image_token_id, chunk=16):
    model.eval()
    qs, ds = [], []
    for s in range(0, len(items), chunk):
        q, d = encode(model, items, list(range(s, min(s + chunk, len(items)))), tok, image_token_id)
        qs.append(q), ds.append(d)
    model.train()
    scores = torch.cat([torch.cat([maxsim(q, d) for d in ds], dim=1) for q in qs])
    ranks = (scores >= scores.diag()[:, None]).sum(1)  # pessimistic ties
    ndcg = torch.where(ranks <= 5, 1.0 / torch.log2(ranks.float() + 1), torch.zeros(())).mean()
    n = len(items)
    rnd = sum(1.0 / math.log2(r + 1) for r in range(1, min(5, n) + 1)) / n
    all_d = type(ds[0])(torch.cat([F.pad(d.embeddings, (0, 0, 0, max(x.embeddings.shape[1] for x in ds) - d.embeddings.shape[1])) for d in ds]),
                        torch.cat([F.pad(d.mask, (0, max(x.mask.shape[1] for x in ds) - d.mask.shape[1])) for d in ds]))
    return float(ndcg), rnd, doc_cosine(all_d)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--init-range", type=float, default=R.initializer_range)
    ap.add_argument("--lr", type=float, default=R.lr)
    ap.add_argument("--head-lr", type=float, default=R.head_lr)
    ap.add_argument("--temperature", type=float, default=R.temperature)
    ap.add_argument("--steps", type=int, default=R.max_steps)
    ap.add_argument("--batch", type=int, default=R.global_batch_size)
    ap.add_argument("--warmup", type=int, default=R.warmup_steps)
    ap.add_argument("--train", type=int, default=R.max_train_samples)
    ap.add_argument("--dev", type=int, default=64)
    ap.add_argument("--max-pixels", type=int, default=R.max_pixels)
    ap.add_argument("--eps", type=float, default=R.l2_eps)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=str, default=None)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    root = build_rdocs(train_limit=DEFAULT_JOB_TRAIN_PAIRS, dev_limit=DEFAULT_JOB_DEV_PAIRS)
    records = [json.loads(line) for line in (root / "manifest.jsonl").read_text().splitlines()]
    train = [r for r in records if r["split"] == "train"][: args.train]
    dev = [r for r in records if r["split"] == "dev"][: args.dev]
    tok = make_tokenizer(["Query: " + r["query"] for r in records] + [DOC_PROMPT], 2048)
    imgproc = Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=args.max_pixels)
    t0 = time.time()
    tr_items, dev_items = encode_items(train, root, tok, imgproc), encode_items(dev, root, tok, imgproc)
    image_token_id = tok.convert_tokens_to_ids("<|image_pad|>")
    print(f"preprocessed {len(tr_items)}+{len(dev_items)} pairs in {time.time() - t0:.1f}s")
    model = build_retriever("tiny", processor=tok, tiny_sizes=TinySizes(initializer_range=args.init_range),
                            eps=args.eps, seed=args.seed)
    opt = torch.optim.AdamW(model.parameter_groups(args.lr, args.head_lr, weight_decay=0.0))
    sched = get_cosine_schedule_with_warmup(opt, min(args.warmup, args.steps - 1), args.steps)  # as raggedvl train

    before = evaluate(model, tr_items[:64], tok, image_token_id) + evaluate(model, dev_items, tok, image_token_id)
    print(f"before: train nDCG@5 {before[0]:.3f} (random {before[1]:.3f}) cos {before[2]:.4f} | dev {before[3]:.3f} (random {before[4]:.3f})")
    order, losses, t0 = [], [], time.time()
    for step in range(args.steps):
        if len(order) < args.batch:
            perm = list(range(len(tr_items)))
            random.shuffle(perm)
            order += perm
        idx, order = order[: args.batch], order[args.batch:]
        q, d = encode(model, tr_items, idx, tok, image_token_id)
        loss = F.cross_entropy(maxsim(q, d) / args.temperature, torch.arange(len(idx)))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % 25 == 0 or step == args.steps - 1:
            print(f"step {step:4d} loss {sum(losses[-25:]) / len(losses[-25:]):.3f} grad {float(gn):.2e} "
                  f"doc cos {doc_cosine(d):.4f} {(time.time() - t0) / (step + 1):.2f}s/step", flush=True)
    after = evaluate(model, tr_items[:64], tok, image_token_id) + evaluate(model, dev_items, tok, image_token_id)
    print(f"after: train nDCG@5 {after[0]:.3f} (random {after[1]:.3f}) cos {after[2]:.4f} | dev {after[3]:.3f} (random {after[4]:.3f})")
    last = sum(losses[-20:]) / 20
    print(f"| init {args.init_range} | lr {args.lr} | head lr {args.head_lr} | T {args.temperature} | steps {args.steps} | G {args.batch} "
          f"| loss first20 {sum(losses[:20]) / 20:.3f} last20 {last:.3f} (ln G/2 = {math.log(args.batch) / 2:.3f}) "
          f"| train nDCG@5 {before[0]:.3f}->{after[0]:.3f} (rnd {after[1]:.3f}) | dev {before[3]:.3f}->{after[3]:.3f} (rnd {after[4]:.3f}) "
          f"| cos {before[2]:.4f}->{after[2]:.4f} | {platform.processor() or platform.machine()}, torch {torch.__version__} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "losses": losses, "before": before, "after": after}))


if __name__ == "__main__":
    main()
